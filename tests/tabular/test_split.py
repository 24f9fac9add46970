"""Splits: a hash of the row number (RecBole's random 8:1:1), by time, and by file."""

import json

import numpy as np
import pytest

from embedlib import tabular
from embedlib.tabular import saved
from embedlib.tabular import split as split_lib
from embedlib.tabular.schema import SchemaError
from tests.tabular import logs
from tests.tabular import reference as ref

ROWS = logs.click_rows(60, seed=1)
PARTS = ("train", "eval", "test")


@pytest.fixture(scope="module")
def clicks(tmp_path_factory):
  return logs.write_parquet(tmp_path_factory.mktemp("split") / "clicks.parquet", ROWS,
                            row_group_size=9)


def stamps_of(data, part) -> list:
  """The timestamps (one a row: the rows' identities) of ``part``, in file order."""
  batches = data.source(part, batch_size=4, pad_last=True, num_epochs=1)
  return ref.concat(batches)["timestamp"].astype(np.int64).tolist()


@pytest.mark.parametrize("eval_fraction, test_fraction", [(0.1, 0.1), (0.25, 0.0), (0.3, 0.5)])
def test_hash_split_fractions_are_disjoint_and_cover_every_row(eval_fraction, test_fraction):
  split = tabular.Split("hash", eval_fraction=eval_fraction, test_fraction=test_fraction, seed=3)
  rows = np.arange(200_000)
  masks = [split.mask(p, rows, None) for p in PARTS]
  assert (sum(m.astype(int) for m in masks) == 1).all()  # each row in exactly one part
  for m, share in zip(masks, (1 - eval_fraction - test_fraction, eval_fraction, test_fraction)):
    assert abs(m.mean() - share) < 0.005
  assert split.mask("all", rows, None).all()
  other = tabular.Split("hash", eval_fraction=eval_fraction, test_fraction=test_fraction, seed=4)
  assert (other.mask("eval", rows, None) != masks[1]).any()  # the seed draws another split
  assert split.has_test == (test_fraction > 0)


def test_recbole_like_8_1_1_split_of_a_file(clicks):
  split = tabular.Split("hash", eval_fraction=0.1, test_fraction=0.1)
  data = tabular.prepare(clicks, logs.HINTS, split=split)
  parts = {p: stamps_of(data, p) for p in PARTS}
  every = [r["timestamp"] for r in ROWS]
  assert sorted(sum(parts.values(), [])) == sorted(every)  # disjoint and covering
  masks = {p: split.mask(p, np.arange(len(ROWS)), None) for p in PARTS}
  for p in PARTS:
    assert parts[p] == [t for t, m in zip(every, masks[p]) if m]  # the rows the mask says
  assert 0 < len(parts["eval"]) < 15 and 0 < len(parts["test"]) < 15
  # The statistics are the training rows': a vocabulary of them, a mean of them.
  train = [r for r, m in zip(ref.parquet_rows([clicks]), masks["train"]) if m]
  got = ref.concat(data.source("test", batch_size=4, pad_last=True, num_epochs=1))
  test_rows = [r for r, m in zip(ref.parquet_rows([clicks]), masks["test"]) if m]
  ref.assert_equal(got, ref.featurize(test_rows, data.schema, train), dense_rtol=1e-6)
  assert data.schema["item_id"].num_embeddings == 1 + len(ref.vocabulary(data.schema["item_id"],
                                                                         train))


@pytest.mark.parametrize("test_time", [0, logs.T0 + 60 * 50])
def test_time_split(clicks, test_time):
  split_time = logs.T0 + 60 * 40
  split = tabular.Split("time", split_time=split_time, test_time=test_time)
  data = tabular.prepare(clicks, logs.HINTS, split=split)
  every = [r["timestamp"] for r in ROWS]
  end = test_time or np.inf
  assert stamps_of(data, "train") == [t for t in every if t < split_time]
  assert stamps_of(data, "eval") == [t for t in every if split_time <= t < end]
  assert split.has_test == bool(test_time)
  if test_time:
    assert stamps_of(data, "test") == [t for t in every if t >= test_time]
  else:  # no test rows: one epoch of nothing; endless epochs of nothing are an error
    assert list(data.source("test", batch_size=4, num_epochs=1)) == []
    with pytest.raises(tabular.DataError, match=r"the test rows hold fewer than batch_size"):
      next(data.source("test", batch_size=4))
  # The statistics are the training rows' (those before split_time).
  train = [r for r in ref.parquet_rows([clicks]) if r["timestamp"] < split_time]
  mean, _ = ref.moments(data.schema["price"], train)
  assert json.loads(data.statistics)["columns"]["price"]["mean"] == pytest.approx(mean, rel=1e-12)


def test_a_bad_split_is_refused_with_the_fix():
  with pytest.raises(SchemaError, match=r"test_time=5 must come after split_time=9"):
    tabular.Split("time", split_time=9, test_time=5)
  with pytest.raises(SchemaError, match=r"eval_fraction=0\.6, test_fraction=0\.4: .* both "
                     r"together < 1"):
    tabular.Split("hash", eval_fraction=0.6, test_fraction=0.4)
  with pytest.raises(SchemaError, match=r"config\.data\.split='random'; use one of"):
    tabular.Split("random")


def test_files_split_trains_on_one_path_and_evaluates_another_with_its_statistics(tmp_path):
  train_path = logs.write_parquet(tmp_path / "train.parquet", ROWS[:40])
  eval_path = logs.write_text(tmp_path / "eval.csv", ROWS[40:])
  data = tabular.prepare(train_path, logs.HINTS, split=tabular.Split("files"))
  assert stamps_of(data, "train") == [r["timestamp"] for r in ROWS[:40]]
  saved.save(str(tmp_path), data.schema, data.statistics)
  held = tabular.prepare(eval_path, saved=str(tmp_path), split=tabular.Split("files"))
  assert held.schema == data.schema
  got = ref.concat(held.source("all", batch_size=4, pad_last=True, num_epochs=1))
  train_rows = list(ref.parquet_rows([train_path]))
  eval_rows = list(ref.text_rows([eval_path], data.schema))
  ref.assert_equal(got, ref.featurize(eval_rows, data.schema, train_rows), dense_rtol=1e-6)
  assert split_lib.Split("files").mask("eval", np.arange(3), None).all()
