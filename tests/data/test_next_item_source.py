"""Next-item batches from a leave-one-out split: windows, padding, eval rows, resume, processes."""

import numpy as np
import pytest

from embedlib.data.movielens import Ragged, Split
from embedlib.data.next_item import NextItemSource

L = 4


def _split(lengths, seed=0):
  """Users with ``lengths`` training items, every item id used once (so a target names its slot)."""
  rng = np.random.default_rng(seed)
  lengths = np.asarray(lengths)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  n = len(lengths)
  ids = rng.permutation(offsets[-1] + 2 * n) + 1
  train = ids[:offsets[-1]].astype(np.int32)
  times = (np.arange(offsets[-1]) * 10 + 1000).astype(np.int64)
  ends = offsets[1:]
  return Split(
      num_users=n, num_items=int(ids.max()), item_titles={},
      train_items=Ragged(train, offsets), train_times=Ragged(times, offsets),
      valid_item=ids[offsets[-1]:offsets[-1] + n].astype(np.int32),
      valid_time=(ends * 10 + 5000).astype(np.int64),
      test_item=ids[offsets[-1] + n:].astype(np.int32),
      test_time=(ends * 10 + 6000).astype(np.int64))


SPLIT = _split([1, 2, 4, 5, 6, 13, 9])  # windows of L + 1: 0, 1, 1, 1, 2, 3, 2


def _epoch(source, epoch):
  return [source.batch(epoch * source.batches_per_epoch + i)
          for i in range(source.batches_per_epoch)]


def test_every_training_item_but_the_first_is_a_target_once_per_epoch():
  source = NextItemSource(SPLIT, max_len=L, batch_size=4, seed=3)
  assert source.windows_per_epoch == 10 and source.batches_per_epoch == 3
  assert source.targets_per_epoch == sum(len(s) - 1 for s in SPLIT.train_items)
  successor = {int(a): int(b) for s in SPLIT.train_items for a, b in zip(s[:-1], s[1:])}
  time_of = dict(zip(SPLIT.train_items.values.tolist(), SPLIT.train_times.values.tolist()))
  orders = []
  for epoch in range(2):
    batches = _epoch(source, epoch)
    targets = np.concatenate([b["targets"].ravel() for b in batches])
    assert sorted(targets[targets > 0].tolist()) == sorted(successor.values())
    for b in batches:
      items, targets = b["items"], b["targets"]
      # Left-padded: once a row starts, it runs to the end.
      assert np.all(np.diff((items > 0).astype(int), axis=1) >= 0)
      assert np.array_equal(targets > 0, items > 0) and np.array_equal(b["times"] > 0, items > 0)
      for item, target, query in zip(items.ravel(), targets.ravel(), b["query_times"].ravel()):
        if target:
          assert successor[item] == target and query == time_of[target]
    orders.append(np.concatenate([b["items"][:, -1] for b in batches]))
  assert not np.array_equal(orders[0], orders[1])  # reshuffled per epoch
  last = _epoch(source, 0)[-1]
  assert (last["items"].sum(axis=1) == 0).sum() == 2  # 10 windows fill 3 batches of 4


def test_a_batch_is_a_function_of_its_number_and_splits_over_processes():
  source = NextItemSource(SPLIT, max_len=L, batch_size=4, seed=1)
  run = [next(source) for _ in range(7)]  # across an epoch boundary
  resumed = NextItemSource(SPLIT, max_len=L, batch_size=4, seed=1)
  resumed.set_state({"position": 4})
  for got, want in zip([next(resumed) for _ in range(3)], run[4:]):
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert len({int(s) for b in run for s in b["seed"]}) == 28  # fresh per row and batch
  halves = [NextItemSource(SPLIT, max_len=L, batch_size=4, seed=1, process_index=i,
                           process_count=2).batch(5) for i in range(2)]
  for k in run[5]:
    np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), run[5][k], err_msg=k)


@pytest.mark.parametrize("kind", ["valid", "test"])
def test_eval_rows_hold_the_last_items_before_the_held_out_one(kind):
  source = NextItemSource(SPLIT, max_len=L, batch_size=4, kind=kind, exclude_seen=True)
  assert len(source) == 2
  batches = list(source)
  weight = np.concatenate([b["weight"] for b in batches])
  assert weight.tolist() == [1.0] * 7 + [0.0]
  for u in range(SPLIT.num_users):
    b, row = batches[u // 4], u % 4
    history = SPLIT.train_items[u].tolist()
    times = SPLIT.train_times[u].tolist()
    held_out, when = SPLIT.valid_item[u], SPLIT.valid_time[u]
    if kind == "test":
      history, times = history + [SPLIT.valid_item[u]], times + [SPLIT.valid_time[u]]
      held_out, when = SPLIT.test_item[u], SPLIT.test_time[u]
    want = ([0] * L + history)[-L:]
    assert b["items"][row].tolist() == want
    assert b["target"][row] == held_out
    real = b["items"][row] > 0
    assert b["query_times"][row][real].tolist() == (times[1:] + [when])[-real.sum():]
    excluded = b["exclude"][row]
    assert sorted(excluded[excluded > 0].tolist()) == sorted(history)


def test_bad_input_names_the_fix():
  with pytest.raises(ValueError, match="no training target"):
    NextItemSource(_split([1, 1]), max_len=L, batch_size=2)
  with pytest.raises(ValueError, match="kind='eval'; use one of"):
    NextItemSource(SPLIT, max_len=L, batch_size=2, kind="eval")
  with pytest.raises(ValueError, match="batch_size=3 must be a positive multiple"):
    NextItemSource(SPLIT, max_len=L, batch_size=3, process_count=2)


def test_a_shorter_stride_adds_context_and_keeps_each_target_once():
  source = NextItemSource(SPLIT, max_len=L, batch_size=4, seed=3, stride=2)
  batches = _epoch(source, 0)
  targets = np.concatenate([b["targets"].ravel() for b in batches])
  assert sorted(targets[targets > 0].tolist()) == sorted(
      int(x) for s in SPLIT.train_items for x in s[1:])
  for b in batches:  # only the last 2 positions predict; up to 2 more items are context
    assert not b["targets"][:, :L - 2].any()
  longest = SPLIT.train_items[5]  # 13 items: cut at 13, 11, ..., 3
  row = next(b["items"][i] for b in batches for i in range(4)
             if b["targets"][i, -1] == longest[-3])
  assert row.tolist() == longest[-7:-3].tolist()
