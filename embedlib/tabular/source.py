"""``TabularSource``: batches of one process's rows of a split, resumable, with workers.

Rows come in chunks (``files.Chunk``: a Parquet row group, or lines of a
text file). A chunk is read (``readers``), its rows of this split and this
process kept (row number ``r`` is process ``r % process_count``'s), turned
into arrays (``featurize.Featurizer``), and, for training, shuffled; batches
are cut from the chunks in order. Each epoch visits the chunks in an order
drawn from the seed and the epoch (or in file order, ``shuffle=False``).

The state (``get_state``) is ``{"position", "epoch", "chunk", "row"}``: the
next batch starts at the ``row``-th kept row of the ``chunk``-th chunk of
that epoch's order. Reading from there gives the batches an uninterrupted
run gives, bit for bit, with any number of workers: with ``workers=N`` the
chunks are read and featurized in N grain worker processes
(``embedlib.data.worker_pool``) and handed back in order. Memory holds a
few chunks, whatever the size of the files.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from embedlib.data import _hashing
from embedlib.data import worker_pool
from embedlib.tabular import featurize
from embedlib.tabular import files as files_lib
from embedlib.tabular import readers
from embedlib.tabular import recbole
from embedlib.tabular import schema as schema_lib
from embedlib.tabular import split as split_lib
from embedlib.tabular import stats as stats_lib
from embedlib.tabular.featurize import Featurizer
from embedlib.tabular.files import Chunk, DataError, Files
from embedlib.tabular.schema import Schema

#: Chunks each worker keeps ready.
BUFFER_CHUNKS = 2


@dataclasses.dataclass(frozen=True)
class Reading:
  """What reading a chunk needs (picklable: grain's workers get a copy).

  Attributes:
    files: the path's files.
    chunks: every chunk of them, in file order.
    schema: the columns read.
    split: how rows are parted, and ``part``: which part is read.
    separator: a CSV list column's separator.
    process_index, process_count: this process's share of the rows.
    shuffle: chunks in a drawn order and rows shuffled within a chunk.
    seed: the draws' seed.
  """

  files: Files
  chunks: tuple[Chunk, ...]
  schema: Schema
  split: split_lib.Split = split_lib.Split(split_lib.FILES)
  part: str = split_lib.ALL
  separator: str = readers.LIST_SEPARATOR
  process_index: int = 0
  process_count: int = 1
  shuffle: bool = False
  seed: int = 0

  def order(self, epoch: int) -> np.ndarray:
    """The chunks' order in ``epoch``."""
    n = len(self.chunks)
    if not self.shuffle:
      return np.arange(n)
    return np.random.default_rng(_hashing.derive_key("tabular-chunks", self.seed, epoch)
                                 ).permutation(n)


def read_table(chunk: Chunk, reading: Reading, sides) -> pa.Table:
  """One chunk's typed columns (``readers``), joined with its side files (RecBole)."""
  files = reading.files
  if files.format == files_lib.PARQUET:
    return readers.read_parquet(chunk, reading.schema)
  if files.format == files_lib.RECBOLE:
    return recbole.read_chunk(chunk, reading.schema, files, sides)
  return readers.read_text(chunk, reading.schema, files, reading.separator)


class LoadChunk:
  """Item ``g`` of the stream: chunk ``g % n`` of epoch ``g // n``'s order, read and kept.

  With a featurizer it gives ``{"epoch", "index", "arrays"}`` (this split's
  and process's rows, featurized, shuffled where the reading shuffles);
  without one, ``{"stats", "rows"}``: the statistics of the training rows
  (``stats.chunk_stats``), after checking every row (``featurize.check``:
  null policies, weights' lengths).
  """

  def __init__(self, reading: Reading, featurizer: Featurizer | None, label_threshold=None):
    self.reading, self.featurizer, self.label_threshold = reading, featurizer, label_threshold
    self._sides = None

  def _table(self, chunk: Chunk) -> pa.Table:
    if self._sides is None and self.reading.files.format == files_lib.RECBOLE:
      self._sides = recbole.Sides(self.reading.files, self.reading.schema)
    return read_table(chunk, self.reading, self._sides)

  def __call__(self, g: int) -> dict:
    r = self.reading
    epoch, position = divmod(g, len(r.chunks))
    index = int(r.order(epoch)[position])
    chunk = r.chunks[index]
    table = self._table(chunk)
    rows = chunk.first_row + np.arange(chunk.rows, dtype=np.int64)
    stamps = _timestamps(table, r.schema) if r.split.kind == split_lib.TIME else None
    if self.featurizer is None:
      featurize.check(table, r.schema, chunk.where)
      train = r.split.mask(split_lib.TRAIN, rows, stamps)
      return {"stats": stats_lib.chunk_stats(table.filter(pa.array(train)), r.schema,
                                             self.label_threshold),
              "rows": int(train.sum())}
    keep = r.split.mask(r.part, rows, stamps) & (rows % r.process_count == r.process_index)
    kept = np.flatnonzero(keep)
    arrays = self.featurizer(table.filter(pa.array(keep)),
                             locate=lambda i: chunk.where(int(kept[i])))
    if r.shuffle and len(kept) > 1:
      rng = np.random.default_rng(_hashing.derive_key("tabular-rows", r.seed, epoch, index))
      arrays = _take(arrays, rng.permutation(len(kept)))
    return {"epoch": epoch, "index": position, "arrays": arrays, "rows": len(kept)}


def _timestamps(table: pa.Table, schema: Schema) -> np.ndarray:
  name = schema.role_column(schema_lib.TIMESTAMP)
  if name is None:
    raise schema_lib.SchemaError("config.data.split='time' needs a timestamp column; name it "
                                 "with config.data.timestamp.")
  array = table.column(name).combine_chunks()
  return np.asarray(array.fill_null(np.inf).to_numpy(zero_copy_only=False), np.float64)


def _take(tree, index):
  if isinstance(tree, dict):
    return {k: _take(v, index) for k, v in tree.items()}
  return tree[index]


def _cut(tree, lo: int, hi: int):
  if isinstance(tree, dict):
    return {k: _cut(v, lo, hi) for k, v in tree.items()}
  return tree[lo:hi]


def _join(trees):
  first = trees[0]
  if isinstance(first, dict):
    return {k: _join([t[k] for t in trees]) for k in first}
  return first if len(trees) == 1 else np.concatenate(trees)


def _pad(tree, n: int):
  """Each array of ``tree`` padded to ``n`` rows by repeating its last row."""
  if isinstance(tree, dict):
    return {k: _pad(v, n) for k, v in tree.items()}
  extra = np.repeat(tree[-1:], n - len(tree), axis=0)
  return np.concatenate([tree, extra])


def stream(load: LoadChunk, first: int, stop: int, workers: int):
  """Items ``first .. stop - 1`` of ``load``: in this process, or by ``workers`` processes."""
  if workers:
    return worker_pool.ordered_map(load, first, stop, workers=workers, buffer=BUFFER_CHUNKS)
  return map(load, range(first, stop))


def compute_statistics(reading: Reading, *, label_threshold=None, workers: int = 0):
  """``stats.Statistics`` of the training rows of every chunk, every row checked on the way."""
  out = stats_lib.Statistics()
  items = stream(LoadChunk(reading, None, label_threshold), 0, len(reading.chunks), workers)
  try:
    for item in items:
      out.add(item["stats"])
  finally:
    if hasattr(items, "close"):
      items.close()
  return out


class TabularSource(Iterator[dict]):
  """Batches of this process's rows of one part of a table (see the module docstring).

  Args:
    reading: the files, schema, split and part, process share and shuffle.
    featurizer: the resolved schema's ``Featurizer``.
    batch_size: the global batch; a process yields ``batch_size //
      process_count`` rows a batch.
    num_epochs: passes over the part (None: endless).
    workers: grain worker processes reading chunks (0: this process).
    pad_last: yield an epoch's last partial batch, padded with repeats of
      its last row and a ``"mask"`` (float32, 0 at padding) in every batch;
      without it a partial batch is dropped (``dropped_examples``).
  """

  def __init__(self, reading: Reading, featurizer: Featurizer, *, batch_size: int,
               num_epochs: int | None = None, workers: int = 0, pad_last: bool = False):
    if batch_size % reading.process_count:
      raise ValueError(f"batch_size={batch_size} must be a multiple of the "
                       f"{reading.process_count} processes.")
    self.reading, self.featurizer = reading, featurizer
    self.local_batch_size = batch_size // reading.process_count
    self.num_epochs, self.workers, self.pad_last = num_epochs, int(workers), pad_last
    self.dropped_examples = 0
    self._state = {"position": 0, "epoch": 0, "chunk": 0, "row": 0}
    self._items = None
    self._item, self._row = None, 0

  @property
  def batch_size(self) -> int:
    """The global batch (every process's rows)."""
    return self.local_batch_size * self.reading.process_count

  def get_state(self) -> dict:
    """``{"position", "epoch", "chunk", "row"}``: where the next batch starts."""
    return dict(self._state)

  def set_state(self, state: dict) -> None:
    self.close()
    self._state = {k: int(state[k]) for k in ("position", "epoch", "chunk", "row")}

  def close(self) -> None:
    """Stops the worker processes, if any; the next batch starts them again."""
    if self._items is not None and hasattr(self._items, "close"):
      self._items.close()
    self._items, self._item = None, None

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  # interpreter shutdown
      pass

  def __iter__(self):
    return self

  def _open(self):
    n = len(self.reading.chunks)
    first = self._state["epoch"] * n + self._state["chunk"]
    stop = sys.maxsize // 2 if self.num_epochs is None else self.num_epochs * n
    load = LoadChunk(self.reading, self.featurizer)
    self._items = stream(load, first, stop, self.workers)
    self._item = next(self._items, None)
    self._row = self._state["row"]

  def _advance(self) -> None:
    """Moves past the current chunk (the state names the next one's first row)."""
    n = len(self.reading.chunks)
    epoch, chunk = self._state["epoch"], self._state["chunk"] + 1
    if chunk == n:
      epoch, chunk = epoch + 1, 0
    self._state.update(epoch=epoch, chunk=chunk, row=0)
    self._item, self._row = next(self._items, None), 0

  def __next__(self) -> dict:
    if self.num_epochs is not None and self._state["epoch"] >= self.num_epochs:
      raise StopIteration
    if self._items is None:
      self._open()
    parts, have, epoch = [], 0, self._state["epoch"]
    fresh = False  # this call began an epoch at its first row
    while have < self.local_batch_size:
      item = self._item
      if item is None or item["epoch"] != epoch:  # the epoch's rows are all read
        if have and self.pad_last:
          break
        self.dropped_examples += have
        if item is None:
          self.close()
          raise StopIteration
        if fresh:
          raise DataError(
              f"{self.reading.files.paths[0]}: the {self.reading.part} rows hold fewer than "
              f"batch_size // process_count = {self.local_batch_size} rows for process "
              f"{self.reading.process_index}; use a smaller batch_size or more data.")
        parts, have, epoch, fresh = [], 0, item["epoch"], True
        continue
      take = min(self.local_batch_size - have, item["rows"] - self._row)
      if take > 0:
        parts.append(_cut(item["arrays"], self._row, self._row + take))
        self._row += take
        have += take
        self._state["row"] = self._row
      if self._row >= item["rows"]:
        self._advance()
    self._state["position"] += 1
    batch = _join(parts)
    if self.pad_last:
      mask = np.zeros(self.local_batch_size, np.float32)
      mask[:have] = 1.0
      if have < self.local_batch_size:
        batch = _pad(batch, self.local_batch_size)
      batch["mask"] = mask
    return batch
