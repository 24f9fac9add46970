"""Training-split statistics: vocabularies, auto id kinds, standardize moments, lengths, labels."""

import collections
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedlib import tabular
from embedlib.tabular import schema as schema_lib
from embedlib.tabular import stats as stats_lib
from embedlib.tabular.schema import SchemaError


@pytest.fixture(scope="module")
def table(tmp_path_factory):
  """300 rows in 7 row groups: ids of known counts, a skewed dense column, lists up to 70 long."""
  rng = np.random.default_rng(5)
  n = 300
  # "b" 60 times, "a" and "c" 50 each (a tie: the order breaks it by value), 7 values twice,
  # 126 once.
  colors = ["b"] * 60 + ["a"] * 50 + ["c"] * 50 + [f"t{i}" for i in range(7)] * 2
  colors += [f"r{i}" for i in range(n - len(colors))]
  rng.shuffle(colors)
  lengths = rng.integers(0, 6, n)
  lengths[123] = 70  # past MAX_LIST_LEN
  path = tmp_path_factory.mktemp("stats") / "t.parquet"
  spend = np.exp(rng.normal(3, 2, n))
  spend[::10] = np.nan
  rating = rng.integers(1, 6, n).astype(np.float64)
  pq.write_table(pa.table({
      "color": colors,
      "few": rng.integers(0, 4, n),
      "many": rng.integers(0, 1000, n),
      "spend": pa.array(spend, from_pandas=True),
      "bag": [list(range(k)) for k in lengths],
      "short": [[1, 2]] * n,
      "rating": rating,
  }), path, row_group_size=45)
  return str(path), colors, spend, lengths, rating


def prepared(table, **columns):
  hints = tabular.Hints(labels=("rating",), columns={
      "color": {"ids": "vocab", "min_count": 2}, **columns})
  return tabular.prepare(table[0], hints, label_threshold=4)


def test_vocab_order_and_min_count(table):
  data = prepared(table)
  vocab = json.loads(data.statistics)["columns"]["color"]["vocab"]
  counts = collections.Counter(table[1])
  assert vocab == ["b", "a", "c"] + [f"t{i}" for i in range(7)]  # most frequent first
  assert all(counts[v] >= 2 for v in vocab) and not any(counts[v] >= 2 for v in counts
                                                         if v not in vocab)
  assert data.schema["color"].num_embeddings == 1 + len(vocab)  # row 0: missing and rare
  ids = np.concatenate([b["sparse"]["color"] for b in
                        data.source("all", batch_size=50, num_epochs=1)])
  want = [vocab.index(c) + 1 if c in vocab else 0 for c in table[1]]
  np.testing.assert_array_equal(ids, want)


def test_auto_takes_a_vocabulary_up_to_auto_vocab_max_and_dynamic_past_it(table, monkeypatch):
  monkeypatch.setattr(schema_lib, "AUTO_VOCAB_MAX", 100)
  s = prepared(table).schema
  assert (s["few"].ids, s["few"].num_embeddings) == ("vocab", 5)  # 4 values and the missing row
  distinct = len(set(pq.read_table(table[0], columns=["many"]).column("many").to_pylist()))
  assert distinct > 100 and s["many"].ids == "dynamic"
  assert s["many"].num_embeddings == max(128, 1 << int(np.ceil(np.log2(2 * distinct))))
  assert s["bag"].ids == "vocab" and s["bag"].num_embeddings == 1 + 70  # 70 values: at most 100
  assert "dynamic, capacity" in s.describe() and "vocab (min_count 2)" in s.describe()


def test_a_vocab_column_past_count_cap_is_refused_and_auto_turns_dynamic(table, monkeypatch):
  monkeypatch.setattr(stats_lib, "COUNT_CAP", 200)  # color has 143 values, many about 260
  with pytest.raises(SchemaError, match=r"column 'many': ids='vocab' over more than 200 distinct "
                     r"training values; give it ids='dynamic'"):
    prepared(table, many={"ids": "vocab"})
  s = prepared(table).schema
  assert s["many"].ids == "dynamic" and s["many"].num_embeddings == 512  # 2 * 200, rounded up
  assert s["color"].ids == "vocab"


def test_standardize_takes_numpys_mean_and_std_of_the_training_rows(table):
  data = prepared(table)
  spend = table[2]
  saved = json.loads(data.statistics)["columns"]["spend"]
  mean, std = np.nanmean(spend), np.nanstd(spend)
  assert saved["mean"] == pytest.approx(mean, rel=1e-12)
  assert saved["std"] == pytest.approx(std, rel=1e-12)
  assert saved["nulls"] == 30 and saved["count"] == 270
  assert (saved["min"], saved["max"]) == (np.nanmin(spend), np.nanmax(spend))
  dense = np.concatenate([b["dense"] for b in data.source("all", batch_size=50, num_epochs=1)])
  want = np.where(np.isnan(spend), 0.0, (spend - mean) / std)  # a null reads the mean
  np.testing.assert_allclose(dense[:, data.schema.dense().index("spend")], want, rtol=1e-6,
                             atol=1e-6)


def test_max_len_from_data_is_capped_at_max_list_len(table):
  s = prepared(table, short={"max_len": 1}).schema
  assert s["bag"].max_len == schema_lib.MAX_LIST_LEN == 64  # the longest row holds 70
  assert s["short"].max_len == 1  # a declared length is kept
  bags = next(tabular.prepare(table[0], tabular.Hints(labels=("rating",), columns={
      "bag": {"ids": "dynamic"}})).source("all", batch_size=300))["sparse"]["bag"]
  assert bags.shape == (300, 64) and bags.dtype == np.uint64
  np.testing.assert_array_equal(bags[123], np.arange(64, dtype=np.uint64))  # the first 64 kept
  np.testing.assert_array_equal((bags != np.uint64(2**64 - 1)).sum(1),
                                np.minimum(table[3], 64))


def test_label_threshold(table):
  data = prepared(table)
  rating = table[4]
  assert json.loads(data.statistics)["columns"]["rating"]["mean"] == pytest.approx(
      (rating >= 4).mean(), rel=1e-12)
  labels = np.concatenate([b["label"] for b in data.source("all", batch_size=50, num_epochs=1)])
  np.testing.assert_array_equal(labels, (rating >= 4).astype(np.float32))
  raw = tabular.prepare(table[0], tabular.Hints(labels=("rating",)))  # no threshold: the values
  np.testing.assert_array_equal(next(raw.source("all", batch_size=300))["label"], rating)
