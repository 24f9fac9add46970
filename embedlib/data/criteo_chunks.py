"""Criteo TSV lines in chunks: parsed in this process or in grain worker processes.

A chunk is up to ``CHUNK_LINES`` consecutive lines of one file. Parsing a
chunk gives this process's rows of it (its split, its ``p (mod n)`` share of
the split's lines) as columns, each row with its global line index, and its
malformed lines with theirs; ``CriteoReader`` cuts batches from the rows and
reports the malformed lines in line order, so every way of making chunks
gives the same batches.

* In this process (``workers=0``), chunks come from reading the files in
  order, plain or ``.gz``.
* With ``workers > 0`` they come from a grain pipeline: one scan of each
  (plain) file finds every chunk's byte range, and grain's worker processes
  read and parse chunks ``g, g + workers, ...`` (chunk ``g`` of the stream is
  chunk ``g % len(table)`` of epoch ``g // len(table)``), handed back in
  order. A gzip file can't be read from the middle, so it is refused there.
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import os
import sys
import zlib

import numpy as np

from embedlib.data import criteo_format as fmt
from embedlib.data import worker_pool

#: Lines per chunk: parsing one takes a worker milliseconds, so handing
#: chunks between processes costs little beside it.
CHUNK_LINES = 4096
_SCAN_BYTES = 1 << 24
#: Chunks each worker keeps ready (grain's per-worker buffer; one more waits
#: in the thread that collects the worker's output, one more is being parsed).
BUFFER_CHUNKS = 1


@dataclasses.dataclass(frozen=True)
class Settings:
  """What parsing a chunk needs to know of the reader (picklable, for workers)."""

  salts: np.ndarray
  buckets: np.ndarray
  raw_ids: bool
  holdout_below: int
  split: str
  process_index: int
  process_count: int


@dataclasses.dataclass(frozen=True)
class ChunkRef:
  """Where a chunk lies: lines ``first_index ..`` (global), ``first_number + 1 ..`` (in file)."""

  path: str
  start: int  # byte offsets of the chunk's first line and past its last
  stop: int
  first_index: int
  first_number: int
  kept_before: int  # lines of the split before this chunk, across the files


def parse_chunk(lines, ref: ChunkRef, settings: Settings, *, epoch: int,
                skip_before: int = 0) -> dict:
  """This process's rows of ``lines`` (the chunk's raw lines, as bytes), as columns.

  Returns:
    ``{"epoch", "line" [n] int64 (global line indices), "label" [n] float32, "dense"
    [n, 13] float32, "ids" [n, 26] (int32 rows, or int64 raw values), "bad": [(index,
    path, line number, reason)]}``; lines before global index ``skip_before`` are
    left out.
  """
  count = len(lines)
  index = np.arange(ref.first_index, ref.first_index + count)
  kept = fmt.in_split(index, settings.holdout_below, settings.split)
  share = (ref.kept_before + np.cumsum(kept) - 1) % settings.process_count
  mine = kept & (share == settings.process_index) & (index >= skip_before)
  labels, ints, cats, rows, bad = [], [], [], [], []
  for j in np.flatnonzero(mine).tolist():
    parsed = fmt.parse_usual(lines[j])
    if parsed is None:  # parse_line reads it, or names what is wrong
      try:
        parsed = fmt.parse_line(lines[j].decode("ascii"))
      except (ValueError, UnicodeDecodeError) as e:
        reason = "not ASCII text" if isinstance(e, UnicodeDecodeError) else str(e)
        bad.append((ref.first_index + j, ref.path, ref.first_number + j + 1, reason))
        continue
    labels.append(parsed[0])
    ints.append(parsed[1])
    cats.append(parsed[2])
    rows.append(ref.first_index + j)
  n = len(rows)
  ints = np.array(ints, np.float64).reshape(n, fmt.CRITEO_NUM_DENSE)
  cats = np.array(cats, np.int64).reshape(n, fmt.CRITEO_NUM_SPARSE)
  return {
      "epoch": epoch,
      "line": np.array(rows, np.int64),
      "label": np.array(labels, np.float32),
      "dense": fmt.to_dense(ints),
      "ids": fmt.to_ids(cats, settings.salts, settings.buckets, settings.raw_ids),
      "bad": bad,
  }


def stream(paths, settings: Settings, *, epoch: int, skip_before: int, num_epochs: int | None):
  """Chunks read in order from ``paths`` (plain or ``.gz``), epoch after epoch.

  Every epoch yields at least one chunk (an empty one for files without
  lines), so the reader sees each epoch end.
  """
  for e in itertools.count(epoch) if num_epochs is None else range(epoch, num_epochs):
    skip = skip_before if e == epoch else 0
    index = kept_before = 0
    yielded = False
    for path in paths:
      opener = gzip.open if path.endswith(".gz") else open
      number, broken = 0, None
      with opener(path, "rb") as f:
        while True:
          try:  # the lines before a break in gzip data are read, then the break reported
            lines = list(itertools.islice(f, CHUNK_LINES))
          except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            broken, lines = err, _readable_lines(path, number)
          if not lines:
            break
          ref = ChunkRef(path, 0, 0, index, number, kept_before)
          index, number = index + len(lines), number + len(lines)
          kept = fmt.in_split(np.arange(ref.first_index, index), settings.holdout_below,
                              settings.split)
          kept_before += int(kept.sum())
          if index > skip:  # chunks wholly before the resume point are counted, not parsed
            yielded = True
            yield parse_chunk(lines, ref, settings, epoch=e, skip_before=skip)
          if broken is not None:
            break
      if broken is not None:
        raise fmt.CriteoFormatError(
            f"{path}:{number + 1}: the gzip data breaks off here ({broken}); the file is "
            "truncated or corrupt: download or compress it again.")
    if not yielded:
      yield parse_chunk([], ChunkRef("", 0, 0, index, 0, kept_before), settings, epoch=e)


def _readable_lines(path: str, skip: int) -> list:
  """The whole lines of a broken gzip file after its first ``skip``, up to the break."""
  lines = []
  with gzip.open(path, "rb") as f:
    try:
      for number, raw in enumerate(f):
        if number >= skip:
          lines.append(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error):
      pass
  if lines and not lines[-1].endswith(b"\n"):
    lines.pop()  # cut off by the break, not a line
  return lines


def scan(paths, settings: Settings) -> list[ChunkRef]:
  """Every chunk's byte range in plain TSV ``paths``, found by one pass over their bytes."""
  refs, index, kept_before = [], 0, 0
  for path in paths:
    if path.endswith(".gz"):
      raise fmt.CriteoFormatError(
          f"{path} is gzip data, which worker processes can't read from the middle; with "
          "workers > 0 pass plain TSV (gunzip it), or convert it once to the binary format "
          f"(python -m embedlib.data.criteo_binary --in {path} --out DIR), or use workers=0.")
    size = os.path.getsize(path)
    starts, lines, offset = [0], 0, 0  # byte offset of every CHUNK_LINES-th line
    with open(path, "rb") as f:
      while block := f.read(_SCAN_BYTES):
        ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10) + (offset + 1)
        at = np.arange(lines + 1, lines + len(ends) + 1) % CHUNK_LINES == 0
        starts.extend(ends[at].tolist())
        lines, offset = lines + len(ends), offset + len(block)
        last = block[-1:]
    total = lines + (1 if size and last != b"\n" else 0)  # a last line without its newline
    if len(starts) > 1 and starts[-1] >= size:
      starts.pop()
    for c, start in enumerate(starts):
      first, count = index + c * CHUNK_LINES, min(CHUNK_LINES, total - c * CHUNK_LINES)
      stop = starts[c + 1] if c + 1 < len(starts) else size
      refs.append(ChunkRef(path, start, stop, first, c * CHUNK_LINES, kept_before))
      kept_before += int(fmt.in_split(np.arange(first, first + count), settings.holdout_below,
                                      settings.split).sum())
    index += total
  return refs


class LoadChunk:
  """Chunk ``g`` of the stream, read and parsed (the function grain's workers run)."""

  def __init__(self, refs: list[ChunkRef], settings: Settings, epoch: int, skip_before: int):
    self.refs, self.settings = refs, settings
    self.epoch, self.skip_before = epoch, skip_before

  def __call__(self, g: int) -> dict:
    epoch, ref = divmod(g, len(self.refs))
    ref = self.refs[ref]
    with open(ref.path, "rb") as f:
      f.seek(ref.start)
      data = f.read(ref.stop - ref.start)
    lines = data.split(b"\n")
    if lines and not lines[-1]:
      lines.pop()  # the newline ending the chunk's last line
    return parse_chunk(lines, ref, self.settings, epoch=epoch,
                       skip_before=self.skip_before if epoch == self.epoch else 0)


def _first_chunk(refs: list[ChunkRef], line: int) -> int:
  """The chunk holding global line ``line`` (or past the last: ``len(refs)``)."""
  starts = np.array([r.first_index for r in refs])
  return max(int(np.searchsorted(starts, line, side="right")) - 1, 0)


def grain_stream(refs: list[ChunkRef], settings: Settings, *, epoch: int, skip_before: int,
                 num_epochs: int | None, workers: int):
  """Chunks parsed by ``workers`` grain worker processes, in order; an iterator with close()."""
  first = epoch * len(refs) + _first_chunk(refs, skip_before)
  stop = sys.maxsize // 2 if num_epochs is None else num_epochs * len(refs)
  return worker_pool.ordered_map(LoadChunk(refs, settings, epoch, skip_before), first, stop,
                                 workers=workers, buffer=BUFFER_CHUNKS)
