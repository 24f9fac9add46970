"""Next-item batches from a leave-one-out split: training windows, validation and test rows.

A split (``embedlib.data.movielens.leave_one_out``, or anything with its
fields) holds each user's training items in time order and one validation
and one test item after them. Item ids lie in ``[1, num_items]``; 0 pads.

The batch format (``L = max_len``, ``B`` this process's rows)::

    # training: each row a window of up to L + 1 consecutive training items,
    # left-padded; position i predicts the item after it
    {
        "items":       int32  [B, L]  inputs, 0 where padded
        "times":       int64  [B, L]  their times (seconds), 0 where padded
        "query_times": int64  [B, L]  the time of the item each position predicts
        "targets":     int32  [B, L]  the next item; 0: no target (padding)
        "seed":        uint32 [B]     per-row randomness (dropout), a function of
                                      (seed, batch number, row) only
    }
    # validation / test: each row one user, the last L items before the held-out one
    {
        "items", "times", "query_times": as above (the last position's query
                                        time is the held-out item's)
        "target":      int32   [B]    the held-out item
        "weight":      float32 [B]    1, or 0 for rows padding the last batch
        "exclude":     int32   [B, S] the user's earlier items, 0-padded
                                      (only with ``exclude_seen=True``)
    }

An epoch cuts every user's training sequence into windows from its newest
item back (the oldest window the shortest), so every training item but a
user's first (it has no history to predict it from) is a target exactly
once per epoch, as in RecBole's augmented sequential epoch; windows are
shuffled per epoch by ``seed``, and the last batch of an epoch is filled out
with empty rows. With ``stride < max_len`` windows end every ``stride``
items and only their last ``stride`` positions are targets: the earlier
ones are context, so every target sees at least ``max_len - stride``
earlier items (where the user has them), for ``max_len / stride`` times
the work. A batch is a function of its number alone, so setting
``position`` resumes exactly.

With ``raw_ids=True`` ``items``, ``targets``, ``target`` and ``exclude``
hold the file's own movie ids (``split.raw_item_ids``, int32 in
``[0, 2**31 - 1)``) and -1 where the layout above has 0 (padding, no
target): the ids a dynamic item table (``embedlib.DynamicEmbed``) reads.

>>> import numpy as np, types
>>> split = types.SimpleNamespace(
...     num_users=1, num_items=5, train_items=[np.array([1, 2, 3, 4], np.int32)],
...     train_times=[np.array([10, 20, 30, 40])], valid_item=np.array([5]),
...     valid_time=np.array([50]), test_item=np.array([2]), test_time=np.array([60]))
>>> batch = next(NextItemSource(split, max_len=3, batch_size=2, kind="train"))
>>> batch["items"].tolist(), batch["targets"].tolist()
([[1, 2, 3], [0, 0, 0]], [[2, 3, 4], [0, 0, 0]])
>>> next(NextItemSource(split, max_len=3, batch_size=1, kind="test"))["items"].tolist()
[[3, 4, 5]]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from embedlib.data import _hashing
from embedlib.data.movielens_requests import raw_ids_of
from embedlib.data.numbered_stream import NumberedStream

TRAIN, VALID, TEST = "train", "valid", "test"
KINDS = (TRAIN, VALID, TEST)


@dataclasses.dataclass(frozen=True)
class NextItemSpec:
  """Sizes of next-item batches: ids ``[1, num_items]`` (0 pads), histories of ``max_len``."""

  num_items: int
  max_len: int
  #: ``{column: int32 [num_items + 1, bag]}``: the items' side columns
  #: (``embedlib.tabular.item_side``), or None.
  item_columns: dict | None = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    for field in ("num_items", "max_len"):
      value = getattr(self, field)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"NextItemSpec.{field} must be an int >= 1, got {value!r}.")

  @property
  def vocab_size(self) -> int:
    """Rows of the item table: the items and the padding row 0."""
    return self.num_items + 1


def _flat(sequences, times):
  """Concatenated sequences and the start of each: ``(items, times, starts [U + 1])``."""
  lengths = np.array([len(s) for s in sequences], np.int64)
  starts = np.zeros(len(lengths) + 1, np.int64)
  np.cumsum(lengths, out=starts[1:])
  items = np.concatenate([np.asarray(s, np.int32) for s in sequences]) if len(sequences) else (
      np.zeros(0, np.int32))
  stamps = np.concatenate([np.asarray(t, np.int64) for t in times]) if len(times) else (
      np.zeros(0, np.int64))
  return items, stamps, starts


def _gather(items, times, ends, starts, width):
  """Rows of the ``width`` entries before each end, left-padded where a row's start cuts in."""
  idx = ends[:, None] - width + np.arange(width)[None, :]
  valid = idx >= starts[:, None]
  safe = np.clip(idx, 0, max(len(items) - 1, 0))
  rows = np.where(valid, items[safe] if len(items) else 0, 0).astype(np.int32)
  stamps = np.where(valid, times[safe] if len(times) else 0, 0).astype(np.int64)
  return rows, stamps


class NextItemSource(NumberedStream):
  """Training windows (an endless stream of epochs) or one split's eval rows.

  Args:
    split: a leave-one-out split (module docstring).
    max_len: ``L``, the most history items a row holds.
    batch_size: global rows per batch; each process yields
      ``batch_size // process_count`` of them.
    seed: shuffles the training windows (per epoch) and draws the rows' seeds.
    stride: targets per training window, at most ``max_len`` (the default);
      the window's positions before them are context.
    kind: ``"train"``, ``"valid"`` (history: the training items) or
      ``"test"`` (history: the training items and the validation item).
    exclude_seen: eval rows carry ``exclude``, every item the user had
      before the held-out one.
    raw_ids: yield the file's movie ids, -1 padding (module docstring).
    process_index, process_count: this process's slice of each batch.
  """

  def __init__(self, split, *, max_len: int, batch_size: int, seed: int = 0,
               stride: int | None = None, kind: str = TRAIN, exclude_seen: bool = False,
               raw_ids: bool = False, process_index: int = 0, process_count: int = 1):
    if kind not in KINDS:
      raise ValueError(f"NextItemSource: kind={kind!r}; use one of {KINDS}.")
    if max_len < 1:
      raise ValueError(f"config.data.max_len must be >= 1, got {max_len}.")
    super().__init__(batch_size=batch_size, process_index=process_index,
                     process_count=process_count)
    stride = max_len if stride is None else stride
    if not 1 <= stride <= max_len:
      raise ValueError(f"config.data.stride={stride} must lie in [1, max_len={max_len}].")
    self.kind, self.max_len, self.seed, self.stride = kind, int(max_len), int(seed), int(stride)
    self.exclude_seen = exclude_seen
    self.num_users = int(split.num_users)
    self.raw_ids = bool(raw_ids)
    if self.raw_ids:
      if getattr(split, "raw_item_ids", None) is None:
        raise ValueError("raw_ids=True: the split has no raw ids; build it with "
                         "movielens.leave_one_out(movielens.load(path)).")
      # Entry 0 of the split's items is padding: it becomes -1.
      self._raw = np.concatenate([[-1], raw_ids_of(split.raw_item_ids[1:], "movie")])
    if kind == TRAIN:
      self._items, self._times, self._starts = _flat(split.train_items, split.train_times)
      self._windows = self._cut_windows()
      if not len(self._windows[0]):
        raise ValueError("the split has no training target: every user's training sequence "
                         "holds one item; use data with more interactions per user.")
      self._target_columns = np.arange(self.max_len) >= self.max_len - self.stride
      self.num_batches = None
      self.batches_per_epoch = -(-len(self._windows[0]) // batch_size)
    else:
      self._eval_arrays(split, kind)
      self.num_batches = -(-self.num_users // batch_size)

  # -- layout -------------------------------------------------------------

  def _cut_windows(self):
    """``(ends, starts)`` in the flat arrays of every window, user by user, newest first."""
    ends, starts = [], []
    lengths = np.diff(self._starts)
    for u in np.flatnonzero(lengths >= 2):
      start, n = self._starts[u], lengths[u]
      cuts = np.arange(n, 1, -self.stride)  # window ends, each with min(stride, end - 1) targets
      ends.append(start + cuts)
      starts.append(np.full(len(cuts), start))
    if not ends:
      return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(ends), np.concatenate(starts)

  def _eval_arrays(self, split, kind):
    train = [np.asarray(s, np.int32) for s in split.train_items]
    train_times = [np.asarray(t, np.int64) for t in split.train_times]
    if kind == TEST:  # the validation item joins the history
      train = [np.append(s, np.int32(v)) for s, v in zip(train, split.valid_item)]
      train_times = [np.append(t, np.int64(v)) for t, v in zip(train_times, split.valid_time)]
      self._target = np.asarray(split.test_item, np.int32)
      self._target_time = np.asarray(split.test_time, np.int64)
    else:
      self._target = np.asarray(split.valid_item, np.int32)
      self._target_time = np.asarray(split.valid_time, np.int64)
    self._items, self._times, self._starts = _flat(train, train_times)
    self.exclude_width = int(np.diff(self._starts).max(initial=1))

  @property
  def windows_per_epoch(self) -> int:
    """Training rows in an epoch."""
    return len(self._windows[0])

  @property
  def targets_per_epoch(self) -> int:
    """Training targets in an epoch: every training item but each user's first."""
    lengths = np.diff(self._starts)
    return int(np.maximum(lengths - 1, 0).sum())

  def batch(self, index: int) -> dict:
    """This process's rows of global batch ``index`` (position unchanged)."""
    first = self.process_index * self.local_batch_size
    rows = np.arange(first, first + self.local_batch_size)
    batch = self._train_batch(index, rows) if self.kind == TRAIN else self._eval_batch(index, rows)
    return self._as_raw(batch) if self.raw_ids else batch

  def _as_raw(self, batch: dict) -> dict:
    """``batch`` with the file's movie ids, -1 where 0 padded."""
    out = dict(batch)
    for key in ("items", "targets", "target", "exclude"):
      if key in batch:
        out[key] = self._raw[batch[key]].astype(np.int32)
    return out

  # -- batches ------------------------------------------------------------

  def _train_batch(self, index, rows):
    epoch, step = divmod(index, self.batches_per_epoch)
    order = np.random.default_rng([self.seed, epoch]).permutation(self.windows_per_epoch)
    picked = step * self.batch_size + rows
    real = picked < len(order)
    which = order[np.minimum(picked, len(order) - 1)]
    ends, starts = self._windows[0][which], self._windows[1][which]
    # Empty rows fill out the epoch's last batch: a start past the end pads everything.
    starts = np.where(real, starts, ends + 1)
    seq, stamps = _gather(self._items, self._times, ends, starts, self.max_len + 1)
    items = seq[:, :-1]
    counters = (np.uint64(index) * np.uint64(self.batch_size) + rows.astype(np.uint64))
    seeds = _hashing.hash_u64(_hashing.derive_key(self.seed, "rows"), counters)
    return {
        "items": items,
        "times": stamps[:, :-1],
        "query_times": np.where(items > 0, stamps[:, 1:], 0),
        # A window's first item is input only, and so are those before its
        # last `stride` positions: an earlier window has them as targets.
        "targets": np.where((items > 0) & self._target_columns, seq[:, 1:], 0).astype(np.int32),
        "seed": (seeds & np.uint64(0xFFFFFFFF)).astype(np.uint32),
    }

  def _eval_batch(self, index, rows):
    users = index * self.batch_size + rows
    weight = (users < self.num_users).astype(np.float32)
    users = np.where(users < self.num_users, users, 0)  # padding rows repeat user 0
    ends, starts = self._starts[users + 1], self._starts[users]
    items, times = _gather(self._items, self._times, ends, starts, self.max_len)
    target_time = self._target_time[users]
    query_times = np.concatenate([times[:, 1:], target_time[:, None]], axis=1)
    batch = {
        "items": items,
        "times": times,
        "query_times": np.where(items > 0, query_times, 0),
        "target": self._target[users],
        "weight": weight,
    }
    if self.exclude_seen:
      batch["exclude"], _ = _gather(self._items, self._times, ends, starts, self.exclude_width)
    return batch
