"""Every reader against a plain-Python parse of the same rows, featurized by the documented rules."""

import glob
import os

import numpy as np
import pytest

from embedlib import tabular
from embedlib.tabular import files as files_lib
from embedlib.tabular import hashing
from tests.tabular import logs
from tests.tabular import reference as ref

N = 50


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """The same 50-row click log in every layout; text files in chunks of 16 lines."""
  tmp = tmp_path_factory.mktemp("readers")
  rows = logs.click_rows(N)
  (tmp / "dir" / "b").mkdir(parents=True)
  parts = [rows[:17], rows[17:35], rows[35:]]
  logs.write_parquet(tmp / "dir" / "a.parquet", parts[0])
  logs.write_parquet(tmp / "dir" / "b" / "day=2.parquet", parts[1], variant=1)
  logs.write_parquet(tmp / "dir" / "c.pq", parts[2], row_group_size=5)
  (tmp / "dir" / "_SUCCESS").write_text("")  # a marker a Spark job leaves: not data
  logs.write_parquet(tmp / "one.parquet", rows, row_group_size=7)
  logs.write_text(tmp / "clicks.csv", rows)
  logs.write_text(tmp / "clicks.tsv", rows, delimiter="\t")
  logs.write_text(tmp / "clicks.txt", rows, delimiter=";", separator=",")
  logs.write_text(tmp / "excel.csv", rows, encoding="utf-8-sig", end="\r\n")
  return tmp, rows


LAYOUTS = {
    # name: (path under tmp, prepare's keywords, the plain parse's keywords)
    "parquet_file": ("one.parquet", {}, None),
    "parquet_dir": ("dir", {}, None),
    "parquet_glob": ("dir/**/*.*", {}, None),
    "csv": ("clicks.csv", {}, {}),
    "tsv": ("clicks.tsv", {}, {"delimiter": "\t"}),
    "csv_custom": ("clicks.txt", {"delimiter": ";", "separator": ","},
                   {"delimiter": ";", "separator": ","}),
    "csv_bom_crlf": ("excel.csv", {}, {}),  # as a spreadsheet exports "CSV UTF-8"
}


def plain_rows(data, tmp, layout):
  path, _, text = LAYOUTS[layout]
  if text is None:
    if layout == "parquet_file":
      paths = [str(tmp / path)]
    else:
      paths = sorted(p for p in glob.glob(str(tmp / "dir" / "**" / "*"), recursive=True)
                     if p.endswith((".parquet", ".pq")))
    return list(ref.parquet_rows(paths))
  return list(ref.text_rows([str(tmp / path)], data.schema, **text))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reader_equals_a_plain_python_parse(written, layout, monkeypatch):
  monkeypatch.setattr(files_lib, "CHUNK_ROWS", 16)
  tmp, rows = written
  path, kw, _ = LAYOUTS[layout]
  data = tabular.prepare(str(tmp / path), logs.HINTS, **kw)
  plain = plain_rows(data, tmp, layout)
  assert len(plain) == N and [r["item_id"] for r in plain] == [r["item_id"] for r in rows]

  s = data.schema
  assert (s["user_id"].ids, s["item_id"].ids, s["device"].ids) == ("dynamic", "vocab", "hashed")
  assert (s["categories"].ids, s["categories"].max_len) == ("vocab", 3)
  assert s["tags"].weights == "tags_weight" and s["tags"].max_len == 3
  assert s["note"].role == "ignore" and s.dense() == ("price", "hour")
  assert len(files_lib.chunks(data.files)) == {"parquet_file": 8, "parquet_dir": 9,
                                               "parquet_glob": 9}.get(layout, 4)

  got = ref.concat(data.source("all", batch_size=16, pad_last=True, num_epochs=1))
  want = ref.featurize(plain, s, plain)
  ref.assert_equal(got, want, dense_rtol=1e-6)
  # The rules that could go wrong quietly, spelled out on a few rows.
  assert got["sparse"]["user_id"][5] == hashing.MISSING  # row 5's user is null
  assert got["sparse"]["user_id"][0] == ref.raw_id(rows[0]["user_id"])
  assert (got["sparse"]["tags"] == hashing.PAD).any() and (got["weights"]["tags"] == 0).any()
  items = np.array([r["item_id"] for r in rows], object)
  assert set(got["sparse"]["item_id"][items == 5]) == {1}  # the most frequent item
  assert set(got["sparse"]["item_id"][items == 12]) == {0}  # seen once: under min_count 2
  assert got["dense"][0, 0] == 0.0  # a null price reads the mean: 0 after standardize
  np.testing.assert_array_equal(got["label"], [r["clicked"] for r in rows])


def recbole_dataset(tmp):
  """A RecBole dataset: 30 interactions, users and items with side fields, one user missing."""
  folder = tmp / "shop"
  folder.mkdir()
  rng = np.random.default_rng(3)
  lines = ["user_id:token\titem_id:token\trating:float\ttimestamp:float\tcontext:token_seq"]
  for i in range(30):
    context = " ".join(rng.choice(["a", "b", "c"], int(rng.integers(0, 3))))
    lines.append(f"u{int(rng.integers(0, 6))}\ti{int(rng.integers(0, 5))}\t"
                 f"{int(rng.integers(1, 6))}\t{880000000 + 7 * i}\t{context}")
  (folder / "shop.inter").write_text("\n".join(lines) + "\n")
  users = ["user_id:token\tage:float\tgender:token\tzip_code:token"]
  users += [f"u{u}\t{20 + 3 * u}\t{'MF'[u % 2]}\t{'' if u == 2 else 10000 + u}"
            for u in range(5)]  # u5 has no line
  (folder / "shop.user").write_text("\n".join(users) + "\n")
  # rating: the .inter file's column of that name is the one read (Yelp's .item has "stars").
  items = ["item_id:token\tgenres:token_seq\tyear:float\tshelf:float_seq\trating:float"]
  items += [f"i{i}\t{' '.join(['Drama', 'Comedy', 'Horror'][:i % 3 + 1])}\t"
            f"{'' if i == 3 else 1990 + i}\t0.5 1\t9" for i in range(5)]
  (folder / "shop.item").write_text("\n".join(items) + "\n")
  return folder


def test_recbole_reader_joins_the_side_files_like_a_plain_python_join(tmp_path, monkeypatch):
  monkeypatch.setattr(files_lib, "CHUNK_ROWS", 8)
  folder = recbole_dataset(tmp_path)
  hints = tabular.Hints(labels=("rating",),
                        columns={"zip_code": {"ids": "hashed", "num_embeddings": 11},
                                 "user_id": {"ids": "dynamic"}, "year": {"default": 1995.0}})
  data = tabular.prepare(str(folder / "shop.inter"), hints, label_threshold=4)
  s = data.schema
  assert s.features("user") == ("user_id", "gender", "zip_code")
  assert s.features("item") == ("item_id", "genres") and s.dense("item") == ("year",)
  assert s.dense("user") == ("age",) and s["shelf"].role == "ignore"
  assert s["timestamp"].role == "timestamp" and s["context"].role == "categorical_list"
  assert s["genres"].max_len == 3 and s["context"].max_len == 2

  plain = list(ref.recbole_rows(str(folder / "shop.inter"), str(folder / "shop.user"),
                                str(folder / "shop.item"), s))
  assert len(plain) == 30 and any(r["age"] is None for r in plain)  # u5 joins nothing
  got = ref.concat(data.source("all", batch_size=8, pad_last=True, num_epochs=1))
  want = ref.featurize(plain, s, plain, label_threshold=4)
  ref.assert_equal(got, want, dense_rtol=1e-6)
  assert set(np.unique(got["label"])) == {0.0, 1.0}
  i3 = [r["item_id"] == "i3" for r in plain]  # i3's year is null: it reads its default
  mean, std = ref.moments(s["year"], plain)
  assert any(i3) and mean != 1995.0
  np.testing.assert_allclose(got["dense"][i3, s.dense().index("year")], (1995.0 - mean) / std,
                             rtol=1e-6)
