"""Each bad input: one DataError / SchemaError naming the file, the row (line), the column, the fix."""

import dataclasses
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedlib import tabular
from embedlib.tabular import files as files_lib
from embedlib.tabular import readers
from embedlib.tabular import saved
from embedlib.tabular.files import DataError
from embedlib.tabular.schema import SchemaError
from tests.tabular import logs

from embedlib.tabular import infer as infer_lib

ROWS = logs.click_rows(40)
SAMPLE = 1200  # bytes of CSV typed by inference: its first 22 rows (the bad values lie past it)
VALUE_FIX = r"; fix the value, or set the column's role / dtype in the schema"
NULL_FIX = r"; fill the value, or give the column a default"


def changed(i, **values):
  rows = [dict(r) for r in ROWS]
  rows[i].update(values)
  return rows


def read_all(path, hints=logs.HINTS, **kw):
  """prepare (every row checked once) and one pass over the rows' batches."""
  data = tabular.prepare(str(path), hints, **kw)
  return list(data.source("all", batch_size=4, pad_last=True, num_epochs=1))


@pytest.mark.parametrize("chunk_rows", [16_384, 7])
@pytest.mark.parametrize("row, values, pattern", [
    (26, {"price": "abc"}, r"column 'price' holds 'abc', which is not a number" + VALUE_FIX),
    (32, {"item_id": "x7"}, r"column 'item_id' holds 'x7', which is not an int id" + VALUE_FIX),
    (29, {"categories": [1, "x", 2]},
     r"column 'categories' holds 'x', which is not an int id" + VALUE_FIX),
    (35, {"timestamp": "yesterday"}, r"column 'timestamp' holds 'yesterday', which is not a "
     r"number or an ISO 8601 date / time" + VALUE_FIX),
    (13, {"clicked": None}, r"column 'clicked' is null, and its null policy is 'error'" + NULL_FIX),
    (6, {"tags": ["red", "blue"], "tags_weight": [1.0]},
     r"column 'tags_weight' holds 1 weights for the 2 ids of 'tags'; give one weight per id"),
])
def test_a_bad_csv_value_names_its_line_and_column(tmp_path, monkeypatch, chunk_rows, row,
                                                   values, pattern):
  monkeypatch.setattr(files_lib, "CHUNK_ROWS", chunk_rows)
  monkeypatch.setattr(infer_lib, "SAMPLE_BYTES", SAMPLE)
  path = logs.write_text(tmp_path / "clicks.csv", changed(row, **values))
  with pytest.raises(DataError, match=rf"clicks\.csv:{row + 2}: {pattern}"):
    read_all(path)


def test_a_null_in_a_list_whose_policy_is_error_names_its_line(tmp_path):
  rows = [dict(r, tags=["red"], tags_weight=[1.0]) for r in ROWS]  # "" is a null list in CSV
  rows[8].update(tags=["red", None], tags_weight=[1.0, 2.0])
  path = logs.write_text(tmp_path / "clicks.csv", rows)
  hints = dataclasses.replace(logs.HINTS, columns={
      **logs.HINTS.columns, "tags": {"ids": "dynamic", "null": "error"}})
  with pytest.raises(DataError, match=r"clicks\.csv:10: column 'tags' is null in a list, and "
                     r"its null policy is 'error'" + NULL_FIX):
    tabular.prepare(str(path), hints)  # the check pass finds it, before any batch


@pytest.mark.parametrize("line, fields, sample", [(5, "1,2", None), (31, None, SAMPLE)])
def test_a_csv_line_with_the_wrong_number_of_fields_is_named(tmp_path, monkeypatch, line,
                                                              fields, sample):
  monkeypatch.setattr(files_lib, "CHUNK_ROWS", 4)
  if sample:  # past the typed sample: the reader finds it
    monkeypatch.setattr(infer_lib, "SAMPLE_BYTES", sample)
  path = logs.write_text(tmp_path / "clicks.csv", ROWS)
  lines = open(path).read().splitlines(keepends=True)
  lines[line - 1] = (fields + "\n") if fields else lines[line - 1].rstrip("\n") + ",extra\n"
  open(path, "w").write("".join(lines))
  with pytest.raises(DataError, match=rf"clicks\.csv:{line}: not (the header's )?11 fields.*"
                     r"\(CSV parse error: .*\); fix the file"):
    read_all(path)


def test_an_empty_line_inside_a_csv_file_is_named(tmp_path):
  path = tmp_path / "clicks.csv"
  logs.write_text(path, ROWS)
  lines = open(path).read().splitlines(keepends=True)
  open(path, "w").write("".join(lines[:7] + ["\n"] + lines[7:] + ["\n", "\n"]))
  with pytest.raises(DataError, match=r"clicks\.csv:8: an empty line; .*remove it"):
    read_all(path)
  open(path, "w").write("".join(lines + ["\n", "\r\n"]))  # empty lines at the end: no rows
  assert sum(len(b["label"]) for b in read_all(path)) == len(ROWS)


def _parquet_dir(tmp_path, second: pa.Table):
  folder = tmp_path / "logs"
  folder.mkdir()
  logs.write_parquet(folder / "a.parquet", ROWS[:10])
  pq.write_table(second, folder / "b.parquet", row_group_size=4)
  return folder


@pytest.mark.parametrize("change, pattern", [
    (lambda t: t.set_column(t.schema.get_field_index("price"), "price",
                            pa.array([f"{i}.5$" for i in range(t.num_rows)])),
     r"column 'price' holds strings \(string\), but the schema reads it as a dense float; give it "
     r"role 'categorical' \(string ids\), or write numbers"),
    (lambda t: t.set_column(t.schema.get_field_index("categories"), "categories",
                            pa.array(range(t.num_rows))),
     r"column 'categories' holds scalars \(int64\), but the schema reads it as a "
     r"categorical_list \(a list a row\); give it role 'categorical' or 'dense', or write lists"),
    (lambda t: t.drop_columns(["price"]),
     r"no column 'price', which this run's schema reads \(as dense\); the file's columns are "
     r"\[.*\]\. Pass files with the run's columns"),
])
def test_a_parquet_file_of_several_that_no_longer_fits_is_named_with_its_column(
    tmp_path, change, pattern):
  folder = _parquet_dir(tmp_path, change(logs.arrow_table(ROWS[10:])))
  with pytest.raises(DataError, match=r"logs/b\.parquet.*: " + pattern):
    tabular.prepare(str(folder), logs.HINTS)


def test_a_missing_parquet_column_is_named_when_read(tmp_path):
  folder = _parquet_dir(tmp_path, logs.arrow_table(ROWS[10:]).drop_columns(["hour"]))
  files = tabular.find(str(folder))
  schema = infer_lib.infer(tabular.find(str(folder / "a.parquet")), logs.HINTS)
  with pytest.raises(DataError, match=r"b\.parquet: no column 'hour', which the schema reads; "
                     r"the file's columns are \[.*\]\. Write the column, or drop it"):
    readers.read_parquet(files_lib.chunks(files)[-1], schema)


@pytest.mark.parametrize("row, values, pattern", [
    (9, {"clicked": None}, r"column 'clicked' is null, and its null policy is 'error'"),
    (5, {"tags": ["red"], "tags_weight": [1.0, 2.0]},
     r"column 'tags_weight' holds 2 weights for the 1 ids of 'tags'"),
])
def test_a_bad_parquet_value_names_its_row_and_row_group(tmp_path, row, values, pattern):
  rows = changed(row, **values)
  path = tmp_path / "clicks.parquet"
  table = logs.arrow_table(rows)
  if values.get("clicked", 0) is None:
    table = table.set_column(table.schema.get_field_index("clicked"), "clicked", pa.array(
        [None if r["clicked"] is None else bool(r["clicked"]) for r in rows]))
  pq.write_table(table, path, row_group_size=4)
  with pytest.raises(DataError, match=rf"clicks\.parquet, row {row} \(row group {row // 4}\): "
                     + pattern):
    read_all(path)


def test_a_float_id_that_is_not_whole_is_named(tmp_path):
  path = tmp_path / "f.parquet"
  pq.write_table(pa.table({"item_id": [1.0, 2.5, None], "y": [0, 1, 0]}), path)
  with pytest.raises(DataError, match=r"f\.parquet \(row group 0\), its row 1: column 'item_id' "
                     r"holds 2\.5, which is not a whole number, but the schema reads it as int "
                     r"ids; fix the value"):
    read_all(path, tabular.Hints(labels=("y",)))


@pytest.mark.parametrize("name, write, pattern", [
    ("none.parquet", lambda p: pq.write_table(logs.arrow_table(ROWS).slice(0, 0), p),
     r"none\.parquet holds no rows; remove the empty file from the path, or write its rows"),
    ("header.csv", lambda p: open(p, "w").write("a,b\n\n"),
     r"header\.csv holds no rows; remove the empty file"),
    ("zero.csv", lambda p: open(p, "w").close(),
     r"zero\.csv is empty \(no header line\); a CSV / TSV file needs a first line naming"),
])
def test_an_empty_file_is_refused_by_name(tmp_path, name, write, pattern):
  folder = tmp_path / "d"
  folder.mkdir()
  write(folder / name)
  if name.endswith(".parquet"):  # one empty file among others
    logs.write_parquet(folder / "a.parquet", ROWS)
  with pytest.raises(DataError, match=pattern):
    if name.endswith(".parquet"):
      tabular.prepare(str(folder), logs.HINTS)
    else:
      tabular.prepare(str(folder / name))


def test_csv_files_of_one_path_with_other_headers_are_refused_naming_the_column(tmp_path):
  logs.write_text(tmp_path / "a.csv", ROWS)
  logs.write_text(tmp_path / "b.csv", ROWS, columns=[k for k in ROWS[0] if k != "price"])
  with pytest.raises(DataError, match=r"b\.csv: its header differs from .*a\.csv's \(no column "
                     r"'price'\); every file of one path must have the same columns"):
    tabular.find(str(tmp_path))


@pytest.mark.parametrize("file, header, bad", [
    ("d.inter", "user_id:token\titem_id\trating:float", "item_id"),
    ("d.inter", "user_id:token\titem_id:token\trating:number", "rating:number"),
    ("d.user", "user_id:token\tage", "age"),
])
def test_a_bad_recbole_header_names_the_field(tmp_path, file, header, bad):
  files = {"d.inter": "user_id:token\titem_id:token\trating:float", "d.user": "user_id:token"}
  files[file] = header
  for name, head in files.items():
    (tmp_path / name).write_text(head + "\n" + "\t".join(["1"] * len(head.split("\t"))) + "\n")
  with pytest.raises(DataError, match=rf"{re.escape(file)}:1: header field '{bad}' is not "
                     r"'name:type' with type one of \('token', 'token_seq', 'float', "
                     r"'float_seq'\)"):
    tabular.prepare(str(tmp_path / "d.inter"), tabular.Hints(labels=("rating",)))


# -- a saved run's schema against new files (resume, export) -----------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run's workdir holding the schema and statistics of a Parquet click log."""
  tmp = tmp_path_factory.mktemp("run")
  data = tabular.prepare(logs.write_parquet(tmp / "train.parquet", ROWS), logs.HINTS)
  saved.save(str(tmp), data.schema, data.statistics)
  return tmp


@pytest.mark.parametrize("change, pattern", [
    (lambda t: t.rename_columns(["platform" if n == "device" else n for n in t.column_names]),
     r"no column 'device', which this run's schema reads \(as categorical\)"),
    (lambda t: t.set_column(t.schema.get_field_index("categories"), "categories",
                            pa.array([["a"]] * t.num_rows)),
     r"column 'categories' holds list<element: string>, which a categorical_list column of int "
     r"values can't read; .*\(this run's schema, saved in its workdir\)"),
    (lambda t: t.set_column(t.schema.get_field_index("user_id"), "user_id",
                            pa.array(range(t.num_rows))),
     r"column 'user_id' holds int values \(int64\), but the schema reads string ids; set its "
     r"dtype to 'int'"),
])
def test_resume_refuses_parquet_files_that_no_longer_match_naming_the_column(run, tmp_path,
                                                                            change, pattern):
  path = tmp_path / "new.parquet"
  pq.write_table(change(logs.arrow_table(ROWS)), path)
  with pytest.raises(DataError, match=r"new\.parquet.*" + pattern):
    tabular.prepare(str(path), saved=str(run))
  schema, _ = saved.load(str(run))
  with pytest.raises(DataError, match=pattern):
    saved.check_files(tabular.find(str(path)), schema)


def test_resume_takes_matching_files_and_scoring_files_without_labels(run, tmp_path):
  path = logs.write_parquet(tmp_path / "new.parquet", ROWS[:8])
  data = tabular.prepare(path, saved=str(run))
  assert data.schema == saved.load(str(run))[0]
  batch = next(data.source("all", batch_size=8))
  assert batch["sparse"]["item_id"].dtype == "int32" and batch["label"].shape == (8,)
  unlabeled = tmp_path / "score.parquet"
  pq.write_table(logs.arrow_table(ROWS[:8]).drop_columns(["clicked", "note"]), unlabeled)
  with pytest.raises(DataError, match=r"no column 'clicked', which this run's schema reads"):
    tabular.prepare(str(unlabeled), saved=str(run))
  data = tabular.prepare(str(unlabeled), saved=str(run), need_labels=False)
  assert data.ignored == () and "note" in data.schema


def test_resume_refuses_a_csv_or_recbole_file_whose_column_changed(tmp_path):
  logs.write_text(tmp_path / "a.csv", ROWS)
  data = tabular.prepare(str(tmp_path / "a.csv"), logs.HINTS)
  logs.write_text(tmp_path / "b.csv", ROWS, columns=[k for k in ROWS[0] if k != "hour"])
  with pytest.raises(DataError, match=r"b\.csv: no column 'hour', which this run's schema "
                     r"reads \(as dense\)"):
    saved.check_files(tabular.find(str(tmp_path / "b.csv")), data.schema)

  def recbole(zip_type):
    folder = tmp_path / zip_type
    folder.mkdir()
    (folder / "d.inter").write_text("user_id:token\titem_id:token\tr:float\nu\ti\t1\n")
    (folder / "d.user").write_text(f"user_id:token\tzip:{zip_type}\nu\t7\n")
    return tabular.find(str(folder / "d.inter"))

  schema = infer_lib.infer(recbole("token"), tabular.Hints(labels=("r",)))
  with pytest.raises(DataError, match=r"d\.inter: column 'zip' is dense of float there; this "
                     r"run's schema reads it as categorical of string"):
    saved.check_files(recbole("float"), schema)


def test_a_workdir_without_a_saved_schema_is_refused(tmp_path):
  with pytest.raises(SchemaError, match=r"schema\.json is missing: a run on your own files keeps "
                     r"its schema and statistics there"):
    tabular.prepare(logs.write_parquet(tmp_path / "a.parquet", ROWS), saved=str(tmp_path))
