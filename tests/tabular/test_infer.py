"""Schema inference: each Arrow type, RecBole's header types, a CSV sample's types, then Hints."""

import datetime
import decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedlib import tabular
from embedlib.tabular import files as files_lib
from embedlib.tabular import hashing
from embedlib.tabular import readers
from embedlib.tabular.schema import SchemaError

# ``embedlib.tabular.infer`` is also the name of the package's ``infer`` function.
from embedlib.tabular import infer as infer_lib

CAT, LIST, DENSE = "categorical", "categorical_list", "dense"
TIME, IGNORE, WEIGHTS = "timestamp", "ignore", "weights"
DAY = 86_400


def _ts(unit, values, tz=None):
  return pa.array(values, pa.timestamp(unit, tz=tz))


ARROW_TYPES = {
    # name: (column c's values, inferred (role, dtype), read as (Python values))
    "int8": (pa.array([1, -2, None], pa.int8()), (CAT, "int"), [1, -2, None]),
    "int16": (pa.array([300, None], pa.int16()), (CAT, "int"), [300, None]),
    "int32": (pa.array([-70000, 5], pa.int32()), (CAT, "int"), [-70000, 5]),
    "int64": (pa.array([2**62, -1], pa.int64()), (CAT, "int"), [2**62, -1]),
    "uint8": (pa.array([255, 0], pa.uint8()), (CAT, "int"), [255, 0]),
    "uint16": (pa.array([65535], pa.uint16()), (CAT, "int"), [65535]),
    "uint32": (pa.array([2**32 - 1], pa.uint32()), (CAT, "int"), [2**32 - 1]),
    # an id is its 64-bit two's complement: uint64 2**64 - 2 is int64 -2, the same raw id
    "uint64": (pa.array([2**64 - 2, 3, None], pa.uint64()), (CAT, "int"), [-2, 3, None]),
    "bool": (pa.array([True, False, None]), (CAT, "int"), [1, 0, None]),
    "float16": (pa.array([1.5, None], pa.float16()), (DENSE, "float"), [1.5, None]),
    "float32": (pa.array([0.25, -2.0], pa.float32()), (DENSE, "float"), [0.25, -2.0]),
    "float64": (pa.array([1e300, None]), (DENSE, "float"), [1e300, None]),
    "decimal": (pa.array([decimal.Decimal("1.125"), None], pa.decimal128(7, 3)),
                (DENSE, "float"), [1.125, None]),
    "string": (pa.array(["a", None, ""]), (CAT, "string"), ["a", None, ""]),
    "large_string": (pa.array(["a", "b"], pa.large_string()), (CAT, "string"), ["a", "b"]),
    "dictionary": (pa.array(["x", "y", "x", None]).dictionary_encode(), (CAT, "string"),
                   ["x", "y", "x", None]),
    "timestamp_s": (_ts("s", [0, 90]), (TIME, "int"), [0.0, 90.0]),
    "timestamp_ms": (_ts("ms", [1500, None]), (TIME, "int"), [1.5, None]),
    "timestamp_us": (_ts("us", [2_000_000, 250_000]), (TIME, "int"), [2.0, 0.25]),
    "timestamp_ns": (_ts("ns", [1_700_000_000 * 10**9]), (TIME, "int"), [1.7e9]),
    "timestamp_tz": (_ts("ms", [86_400_500], tz="Europe/Paris"), (TIME, "int"), [86400.5]),
    "date32": (pa.array([datetime.date(1970, 1, 3), None]), (TIME, "int"), [2.0 * DAY, None]),
    "list_int": (pa.array([[1, 2], [], None], pa.list_(pa.int32())), (LIST, "int"),
                 [[1, 2], [], None]),
    "list_uint64": (pa.array([[2**64 - 1, 4]], pa.list_(pa.uint64())), (LIST, "int"),
                    [[-1, 4]]),
    "list_string": (pa.array([["a", None], ["b"]]), (LIST, "string"), [["a", None], ["b"]]),
    "large_list": (pa.array([[7], [8, 9]], pa.large_list(pa.int64())), (LIST, "int"),
                   [[7], [8, 9]]),
    "fixed_size_list": (pa.array([[1, 2], [3, 4]], pa.list_(pa.int64(), 2)), (LIST, "int"),
                        [[1, 2], [3, 4]]),
    "list_float": (pa.array([[0.5]], pa.list_(pa.float32())), (IGNORE, "float"), None),
    "struct": (pa.array([{"a": 1}]), (IGNORE, "string"), None),
    "map": (pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64())), (IGNORE, "string"),
            None),
    "binary": (pa.array([b"\x00"]), (IGNORE, "string"), None),
}


@pytest.mark.parametrize("name", list(ARROW_TYPES))
def test_each_arrow_type_is_inferred_and_read(tmp_path, name):
  array, (role, dtype), read = ARROW_TYPES[name]
  path = tmp_path / "t.parquet"
  pq.write_table(pa.table({"c": array}), path)
  files = tabular.find(str(path))
  schema = infer_lib.infer(files)
  assert (schema["c"].role, schema["c"].dtype) == (role, dtype)
  table = readers.read_parquet(files_lib.chunks(files)[0], schema)
  if read is None:
    assert table.column_names == []  # an ignored column is not read
    return
  column = table.column("c")
  assert column.type == readers.arrow_type(schema["c"])
  assert column.to_pylist() == read


def test_an_unsigned_id_past_int64_keeps_its_64_bits(tmp_path):
  path = tmp_path / "u.parquet"
  pq.write_table(pa.table({"c": pa.array([2**64 - 2, 2**63], pa.uint64())}), path)
  files = tabular.find(str(path))
  table = readers.read_parquet(files_lib.chunks(files)[0], infer_lib.infer(files))
  assert hashing.raw_ids(table.column("c")).tolist() == [2**64 - 2, 2**63]


def test_an_int_column_read_as_dense_or_timestamp_keeps_values_past_2_53(tmp_path):
  path = tmp_path / "big.parquet"
  ns = 1_700_000_000_123_456_789
  pq.write_table(pa.table({"t": pa.array([ns]), "n": pa.array([2**60])}), path)
  files = tabular.find(str(path))
  schema = infer_lib.infer(files, tabular.Hints(timestamp="t", dense=("n",)))
  table = readers.read_parquet(files_lib.chunks(files)[0], schema)
  assert table.column("t").to_pylist() == [float(ns)] and table.column("n")[0].as_py() == 2.0**60


def test_list_of_floats_weighs_the_list_it_is_named_after(tmp_path):
  path = tmp_path / "w.parquet"
  f = pa.list_(pa.float32())
  pq.write_table(pa.table({
      "tags": pa.array([["a"]]), "tags_weights": pa.array([[1.0]], f),
      "cats": pa.array([[1]]), "cats_weight": pa.array([[2]], pa.list_(pa.float64())),
      "x": pa.array([1]), "x_weight": pa.array([[1.0]], f),
      "scores": pa.array([[1.0]], f)}), path)
  schema = infer_lib.infer(tabular.find(str(path)))
  assert schema["tags"].weights == "tags_weights" and schema["cats"].weights == "cats_weight"
  assert schema["tags_weights"].role == schema["cats_weight"].role == WEIGHTS
  assert schema["x_weight"].role == schema["scores"].role == IGNORE  # x is no list
  assert schema.features() == ("tags", "cats", "x")


def test_one_time_column_is_the_timestamp_and_the_others_are_ignored(tmp_path):
  path = tmp_path / "t.parquet"
  pq.write_table(pa.table({
      "day": pa.array([datetime.date(2024, 1, 1)]), "seen": _ts("ms", [5]),
      "timestamp": pa.array([7])}), path)
  files = tabular.find(str(path))
  schema = infer_lib.infer(files)
  assert [schema[n].role for n in ("day", "seen", "timestamp")] == [IGNORE, IGNORE, TIME]
  schema = infer_lib.infer(files, tabular.Hints(timestamp="seen"))
  assert [schema[n].role for n in ("day", "seen", "timestamp")] == [IGNORE, TIME, CAT]
  pq.write_table(pa.table({"day": pa.array([datetime.date(2024, 1, 1)]), "v": [1]}), path)
  assert infer_lib.infer(tabular.find(str(path)))["day"].role == TIME  # the only one
  pq.write_table(pa.table({"a": _ts("s", [1]), "b": _ts("s", [2])}), path)
  schema = infer_lib.infer(tabular.find(str(path)))  # two, none named: neither
  assert schema["a"].role == schema["b"].role == IGNORE


def test_recbole_header_types(tmp_path):
  (tmp_path / "d.inter").write_text(
      "user_id:token\titem_id:token\trating:float\ttimestamp:float\tctx:token_seq\t"
      "ctx_weight:float_seq\tscore:float_seq\nu\ti\t1\t2\ta b\t1 2\t3\n")
  (tmp_path / "d.user").write_text("user_id:token\tage:float\tzip:token\nu\t3\t9\n")
  (tmp_path / "d.item").write_text("item_id:token\tgenre:token_seq\nx\ta\n")
  files = tabular.find(str(tmp_path / "d.inter"))
  assert files.format == "recbole" and files.side_paths.keys() == {"user", "item"}
  schema = infer_lib.infer(files, tabular.Hints(labels=("rating",)))
  got = {c.name: (c.role, c.dtype, c.entity) for c in schema.columns}
  assert got == {
      "user_id": ("user_id", "string", "user"), "item_id": ("item_id", "string", "item"),
      "rating": ("label", "float", ""), "timestamp": (TIME, "float", ""),
      "ctx": (LIST, "string", ""), "ctx_weight": (WEIGHTS, "float", ""),
      "score": (IGNORE, "float", ""),
      "age": (DENSE, "float", "user"), "zip": (CAT, "string", "user"),
      "genre": (LIST, "string", "item")}
  assert schema["ctx"].weights == "ctx_weight" and schema["age"].transform == "standardize"
  assert tabular.find(str(tmp_path)).paths == files.paths  # the folder names its one .inter


def test_csv_sample_types(tmp_path):
  path = tmp_path / "s.csv"
  path.write_text(
      "id,price,name,cats,tags,tags_weight,empty,flag,day,y\n"
      "1,0.5,a,1|2,a|b,0.5|1,,true,2024-01-01,1\n"
      "2,,b,3,c,2,,false,2024-01-02,0\n"
      "-3,1e3,,,x|,1|,,,2024-01-03 10:00:00,1\n")
  schema = infer_lib.infer(tabular.find(str(path)), tabular.Hints(labels=("y",)))
  got = {c.name: (c.role, c.dtype) for c in schema.columns}
  assert got == {"id": (CAT, "int"), "price": (DENSE, "float"), "name": (CAT, "string"),
                 "cats": (LIST, "int"), "tags": (LIST, "string"), "tags_weight": (WEIGHTS, "float"),
                 "empty": (CAT, "string"), "flag": (CAT, "int"), "day": (TIME, "int"),
                 "y": ("label", "float")}
  assert schema["tags"].weights == "tags_weight"
  # ... and each reads as its type says.
  files = tabular.find(str(path))
  table = readers.read_text(files_lib.chunks(files)[0], schema, files)
  assert table.column("flag").to_pylist() == [1, 0, None]
  assert table.column("day").to_pylist() == [19723.0 * DAY, 19724.0 * DAY, 19725.0 * DAY + 36000]
  assert table.column("cats").to_pylist() == [[1, 2], [3], None]
  assert table.column("tags_weight").to_pylist() == [[0.5, 1.0], [2.0], [1.0, None]]


def test_csv_sample_reads_a_separator_of_its_own(tmp_path):
  path = tmp_path / "s.csv"
  path.write_text("a;b\n1 2;x\n3;y\n")
  schema = infer_lib.infer(tabular.find(str(path), delimiter=";"), separator=" ")
  assert (schema["a"].role, schema["a"].dtype) == (LIST, "int")


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
  path = tmp_path_factory.mktemp("hints") / "shop.parquet"
  pq.write_table(pa.table({
      "user_id": ["u"], "item_id": [1], "uid": ["v"], "sku": [2.0], "age": [30], "genre": ["g"],
      "price": [1.0], "clicked": [1], "bought": [0.0], "timestamp": [5], "when": [6],
      "junk": ["z"]}), path)
  return tabular.find(str(path))


def test_hints_name_roles_entities_and_fields(shop):
  default = infer_lib.infer(shop)
  assert default["user_id"].role == "user_id" and default["item_id"].role == "item_id"
  assert default["timestamp"].role == TIME and default["clicked"].role == CAT
  assert default["sku"].role == DENSE and default.labels() == ()

  hints = tabular.Hints(
      labels=("clicked", "bought"), user_id="uid", item_id="sku", timestamp="when",
      user_columns=("age",), item_columns=("genre", "price"), dense=("age",), ignore=("junk",),
      columns={"genre": {"ids": "hashed", "num_embeddings": 9},
               "price": {"role": "categorical", "dtype": "int"},
               "when": {"null": "error"}})
  s = infer_lib.infer(shop, hints)
  got = {c.name: (c.role, c.dtype, c.entity) for c in s.columns}
  assert got == {
      "user_id": (CAT, "string", ""), "item_id": (CAT, "int", ""),
      "uid": ("user_id", "string", "user"), "sku": ("item_id", "int", "item"),
      "age": (DENSE, "float", "user"), "genre": (CAT, "string", "item"),
      "price": (CAT, "int", "item"), "clicked": ("label", "float", ""),
      "bought": ("label", "float", ""), "timestamp": (CAT, "int", ""),
      "when": (TIME, "int", ""), "junk": (IGNORE, "string", "")}
  assert s["clicked"].null == "error" and s["when"].null == "error"
  assert s["age"].transform == "standardize" and s["price"].transform == "none"
  assert (s["genre"].ids, s["genre"].num_embeddings) == ("hashed", 9)
  # Float ids (pandas' ints with a null) read as the ints they hold.
  table = readers.read_parquet(files_lib.chunks(shop)[0], s)
  assert table.column("sku").to_pylist() == [2] and table.column("price").to_pylist() == [1]
  assert s.features("user") == ("uid",) and s.features("item") == ("sku", "genre", "price")


@pytest.mark.parametrize("hint, key", [
    ({"labels": ("click",)}, "label"), ({"user_id": "user"}, "user_id"),
    ({"item_id": "sku_id"}, "item_id"), ({"timestamp": "time"}, "timestamp"),
    ({"user_columns": ("gender",)}, "user_columns"), ({"item_columns": ("brand",)}, "item_columns"),
    ({"dense": ("qty",)}, "dense"), ({"ignore": ("trash",)}, "ignore"),
])
def test_a_hint_naming_an_unknown_column_is_refused_by_name(shop, hint, key):
  (unknown,) = [v if isinstance(v, str) else v[0] for v in hint.values()]
  with pytest.raises(SchemaError, match=rf"config\.data\.{key}: .*no column '{unknown}'; "
                     r"its columns are \[.*'user_id'"):
    infer_lib.infer(shop, tabular.Hints(**hint))


def test_a_column_override_with_an_unknown_field_is_refused_by_name(shop):
  with pytest.raises(SchemaError, match=r"config\.data\.columns\.genre: column 'genre' has "
                     r"unknown key 'vocab_size'"):
    infer_lib.infer(shop, tabular.Hints(columns={"genre": {"vocab_size": 3}}))
  # A column the files lack (a misspelt name would read nothing) is refused by name.
  extra = {"extra": {"role": "dense", "dtype": "float"}}
  with pytest.raises(SchemaError, match=r"config\.data\.columns\.extra: .*shop\.parquet has "
                     r"no column 'extra'"):
    infer_lib.infer(shop, tabular.Hints(columns=extra))

