"""Reader for the Criteo display-advertising TSV layout (plain or .gz).

Each line holds 40 tab-separated fields: the 0/1 label, 13 integer features
``I1..I13`` and 26 categorical features ``C1..C26`` as hex strings (e.g.
``68fd1e64``). Any feature may be empty.

* Integer features become ``log1p(max(x, 0))`` (float32), the customary
  transform for these heavy-tailed counts; empty means 0.
* Categorical values are hashed with a stable per-feature-salted splitmix64
  into rows ``1 .. num_embeddings - 1``; **row 0 is reserved for "missing"**,
  so a model learns one embedding for absent values.
* With ``raw_ids=True`` the categorical values come as they are instead
  (int64, exact: a dynamic table such as ``embedlib.DynamicEmbed`` gives
  each its own row), and a missing value is ``MISSING_RAW`` (``2**60``, which
  no 15-digit hex value reaches), so it too is an id with a learned row.
* Batches have a fixed size: a last partial batch (per epoch) is dropped and
  counted in ``dropped_examples``.
* Process ``p`` of ``n`` reads the ``p (mod n)``-th lines of its split (all
  lines, or the training or held-out share of them); with no malformed
  lines, process batches ``k`` of all processes together hold exactly the
  lines of the 1-process batch ``k``. The last batch of a finite pass is
  where they can differ: process shares of a split need not hold equally
  many batches (its length, the hold-out hash and malformed lines fall
  unevenly), so a multi-process reader of a finite pass steps in lockstep
  with the others (``python -m train`` evaluates while every process has
  a batch; it trains from an endless reader).
* ``holdout`` sets aside a fraction of the lines for evaluation, chosen by a
  hash of the line's index: ``split="train"`` skips them and
  ``split="holdout"`` reads only them, so the two never share a line.
* Malformed lines are reported as ``path:line: reason`` (logged, the first
  ``MAX_REPORTED``) and counted once however many epochs read them;
  ``max_bad_lines`` chooses between skipping (up to a bound) and stopping at
  the first. A ``.gz`` file that is not gzip data is refused at
  construction; one that is truncated or corrupt stops the reader at the
  line where its data breaks.
* ``workers=N`` parses in N grain worker processes (plain TSV files; see
  ``embedlib.data.criteo_chunks``); the batches, malformed-line reports and
  states are those of ``workers=0``, so a run may resume with another count.
  As with any multiprocessing, a script that starts workers keeps its top
  level code under ``if __name__ == "__main__":``. The binary format
  (``embedlib.data.criteo_binary``) is faster still.

Lines are parsed with a regular expression, ``bytes.split`` and ``int``;
nothing is evaluated from the files. Worker processes hand back numpy arrays
of what they parsed; nothing is unpickled from the files.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence

import numpy as np

from embedlib.data import _hashing
from embedlib.data import criteo_chunks
from embedlib.data.criteo_format import (  # re-exported: this module is their public home
    GZIP_MAGIC,
    HOLDOUT_BUCKETS,
    CRITEO_NUM_DENSE,
    CRITEO_NUM_SPARSE,
    MISSING_RAW,
    CriteoFormatError,
    parse_line,
    to_dense,
    to_ids,
)
from embedlib.data.spec import DataSpec, SparseFeature

#: How many malformed lines ``BadLines`` keeps for the report (and the reader logs).
MAX_REPORTED = 10

log = logging.getLogger(__name__)


def criteo_spec(num_embeddings: int | Sequence[int] = 100_000) -> DataSpec:
  """The Criteo layout: 13 dense features and single-hot ``C1..C26``.

  >>> spec = criteo_spec([10] * 25 + [20])
  >>> spec.num_dense, spec.features[-1]
  (13, SparseFeature(name='C26', num_embeddings=20, bag_size=1))

  Args:
    num_embeddings: table size for every feature, or one per feature (26);
      each needs at least 2 rows since row 0 means "missing".

  Returns:
    The spec.
  """
  sizes = [num_embeddings] * CRITEO_NUM_SPARSE if isinstance(num_embeddings, int) else list(num_embeddings)
  if len(sizes) != CRITEO_NUM_SPARSE:
    raise ValueError(f"Criteo has {CRITEO_NUM_SPARSE} categorical features; got {len(sizes)} table sizes.")
  return DataSpec(
      CRITEO_NUM_DENSE,
      tuple(SparseFeature(f"C{i + 1}", int(n)) for i, n in enumerate(sizes)),
  )


@dataclasses.dataclass
class BadLines:
  """Malformed lines seen by this process: a total and the first few.

  >>> bad = BadLines()
  >>> [bad.add("a.tsv", 3, "label must be 0 or 1, got '2'") for epoch in range(2)]
  [True, False]
  >>> print(bad)
  1 malformed line(s); first: a.tsv:3: label must be 0 or 1, got '2'
  """

  count: int = 0
  first: list = dataclasses.field(default_factory=list)  # [(path, line, reason)]
  _seen: set = dataclasses.field(default_factory=set, repr=False)

  def add(self, path: str, line: int, reason: str) -> bool:
    """Counts a malformed line; False if it was counted before (a later epoch)."""
    if (path, line) in self._seen:
      return False
    self._seen.add((path, line))
    self.count += 1
    if len(self.first) < MAX_REPORTED:
      self.first.append((path, line, reason))
    return True

  def __str__(self) -> str:
    shown = "; ".join(f"{p}:{n}: {r}" for p, n, r in self.first)
    return f"{self.count} malformed line(s); first: {shown}" if self.count else "no malformed lines"


class CriteoReader(Iterator[dict]):
  """Batches of one process's share of Criteo TSV files, resumable.

  >>> import os, tempfile
  >>> path = os.path.join(tempfile.mkdtemp(), "day_0.tsv")
  >>> line = "\\t".join(["1", "3"] + [""] * 12 + ["a1b2"] * 26) + "\\n"
  >>> _ = open(path, "w").write(line * 5)
  >>> reader = CriteoReader(path, criteo_spec(1000), batch_size=2)
  >>> [b["label"].tolist() for b in reader], reader.dropped_examples
  ([[1.0, 1.0], [1.0, 1.0]], 1)

  Args:
    paths: a file path or a sequence of them, read in order; ``.gz`` files
      are decompressed.
    spec: table sizes, from ``criteo_spec``; default 100,000 rows each.
    batch_size: global batch size; each process yields
      ``batch_size // process_count`` rows.
    process_index: this process's index in ``[0, process_count)``.
    process_count: number of processes splitting the lines.
    max_bad_lines: malformed lines to skip before raising; 0 (default) stops
      at the first, None skips all. ``bad_lines`` reports them either way.
    num_epochs: passes over the files, or None to repeat forever.
    holdout: fraction of the lines, in ``[0, 1)``, held out for evaluation.
    split: with ``holdout > 0``, ``"train"`` reads the other lines and
      ``"holdout"`` the held-out ones.
    raw_ids: yield the categorical values themselves (int64; missing is
      ``MISSING_RAW``) rather than rows hashed mod each table's size; the
      spec's sizes are then unused.
    workers: parse in this many grain worker processes (plain TSV files
      only); 0 parses in this process. The batches and states are the same
      for every count. ``close()`` stops the workers.

  Raises:
    FileNotFoundError: at construction, naming a path that does not exist.
    IsADirectoryError: at construction, naming a path that is a directory.
    CriteoFormatError: at construction, for a ``.gz`` path that isn't gzip
      data (or a gzip file without ``.gz``), or any ``.gz`` path with
      ``workers > 0``; while reading, as described in the module docstring.
  """

  def __init__(
      self,
      paths: str | os.PathLike | Sequence[str | os.PathLike],
      spec: DataSpec | None = None,
      *,
      batch_size: int,
      process_index: int = 0,
      process_count: int = 1,
      max_bad_lines: int | None = 0,
      num_epochs: int | None = 1,
      holdout: float = 0.0,
      split: str = "train",
      raw_ids: bool = False,
      workers: int = 0,
  ):
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
      raise ValueError("CriteoReader needs at least one path.")
    self.paths = [os.fspath(p) for p in paths]
    for path in self.paths:
      if os.path.isdir(path):
        raise IsADirectoryError(
            f"Criteo data file {path!r} is a directory; pass the path of a .tsv or .tsv.gz "
            "file in it (or a list of them).")
      if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Criteo data file {path!r} does not exist (or is not a file); pass the path "
            "of a .tsv or .tsv.gz file in the Criteo layout."
        )
      with open(path, "rb") as f:
        gzipped = f.read(2) == GZIP_MAGIC
      if gzipped != path.endswith(".gz"):
        raise CriteoFormatError(
            f"{path} ends in .gz but is not gzip data; rename it without .gz if it is plain "
            "TSV, or compress it with gzip." if path.endswith(".gz") else
            f"{path} is gzip data; name it with a .gz suffix so that it is decompressed.")
    if not 0.0 <= holdout < 1.0 or split not in ("train", "holdout"):
      raise ValueError(
          f"holdout={holdout!r}, split={split!r}: pass a holdout fraction in [0, 1) and "
          "split='train' or 'holdout'.")
    if split == "holdout" and holdout == 0.0:
      raise ValueError("split='holdout' with holdout=0 reads nothing; pass holdout=0.05, say.")
    spec = criteo_spec() if spec is None else spec
    if spec.num_dense != CRITEO_NUM_DENSE or len(spec.features) != CRITEO_NUM_SPARSE or any(
        f.bag_size != 1 or f.num_embeddings < 2 for f in spec.features
    ):
      raise ValueError(
          "CriteoReader needs a spec with 13 dense and 26 single-hot features of at "
          "least 2 rows each; build it with criteo_spec(num_embeddings)."
      )
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index={process_index} must lie in [0, process_count={process_count}).")
    if batch_size < 1 or batch_size % process_count:
      raise ValueError(
          f"batch_size={batch_size} must be a positive multiple of process_count={process_count}."
      )
    self.spec = spec
    self.batch_size, self.local_batch_size = batch_size, batch_size // process_count
    self.process_index, self.process_count = process_index, process_count
    self.max_bad_lines, self.num_epochs = max_bad_lines, num_epochs
    self.holdout, self.split = float(holdout), split
    self.raw_ids = bool(raw_ids)
    self._holdout_below = int(round(self.holdout * HOLDOUT_BUCKETS))
    salts = [_hashing.derive_key("criteo", f.name) for f in spec.features]
    self._salts = np.array(salts, np.uint64)
    self._buckets = np.array([f.num_embeddings - 1 for f in spec.features], np.uint64)
    self.bad_lines = BadLines()
    self.dropped_examples = 0
    self._state = {"position": 0, "epoch": 0, "line": 0}
    self.workers = int(workers)
    self._settings = criteo_chunks.Settings(
        self._salts, self._buckets, self.raw_ids, self._holdout_below, split, process_index,
        process_count)
    # With workers, every chunk's byte range, found once (plain files only).
    self._refs = criteo_chunks.scan(self.paths, self._settings) if self.workers else None
    self._chunks = None  # the chunk stream, opened at the first batch after a set_state
    self._chunk, self._row, self._bad_row = None, 0, 0  # the chunk being cut, and where

  # -- state -------------------------------------------------------------------

  @property
  def position(self) -> int:
    """Number of batches yielded so far (across epochs)."""
    return self._state["position"]

  def get_state(self) -> dict:
    """``{"position", "epoch", "line"}``: where the next batch starts.

    The same with any number of workers, so a run may resume with another.
    """
    return dict(self._state)

  def set_state(self, state: dict) -> None:
    """Resumes from ``get_state()``; ``{"position": k}`` alone replays k batches.

    A position-only state is the same on every process, so one number can
    resume all of them (at the cost of re-parsing their lines).
    """
    self.close()
    if "line" in state:
      self._state = {k: int(state[k]) for k in ("position", "epoch", "line")}
      return
    self._state = {"position": 0, "epoch": 0, "line": 0}
    for _ in range(int(state["position"])):
      next(self)

  def close(self) -> None:
    """Stops the worker processes, if any; the next batch starts them again."""
    if self._chunks is not None and hasattr(self._chunks, "close"):
      self._chunks.close()
    self._chunks, self._chunk = None, None

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  # interpreter shutdown
      pass

  # -- iteration -----------------------------------------------------------------

  def __iter__(self):
    return self

  def _open(self):
    epoch, line = self._state["epoch"], self._state["line"]
    kw = dict(epoch=epoch, skip_before=line, num_epochs=self.num_epochs)
    if self.workers:
      return criteo_chunks.grain_stream(self._refs, self._settings, workers=self.workers, **kw)
    return criteo_chunks.stream(self.paths, self._settings, **kw)

  def __next__(self) -> dict:
    if self.num_epochs is not None and self._state["epoch"] >= self.num_epochs:
      raise StopIteration
    if self._chunks is None:
      self._chunks = self._open()
      self._chunk = next(self._chunks, None)
      self._row = self._bad_row = 0
    parts, have = [], 0
    # Set once this call starts an epoch from its first line: reaching that
    # epoch's end without returning means it holds less than one batch.
    whole_epoch = False
    while have < self.local_batch_size:
      chunk = self._chunk
      if chunk is None or chunk["epoch"] != self._state["epoch"]:  # end of an epoch
        self.dropped_examples += have
        parts, have = [], 0
        epoch = self._state["epoch"] + 1
        self._state.update(epoch=epoch, line=0)
        if self.num_epochs is not None and epoch >= self.num_epochs:
          self.close()
          raise StopIteration
        if whole_epoch:
          raise CriteoFormatError(
              f"{self.paths} hold fewer than batch_size // process_count = "
              f"{self.local_batch_size} valid lines for process {self.process_index}; "
              "use a smaller batch_size or more data."
          )
        whole_epoch = True
        continue
      take = min(self.local_batch_size - have, len(chunk["line"]) - self._row)
      if take:
        parts.append((chunk, self._row, self._row + take))
        self._row += take
        have += take
        last = int(chunk["line"][self._row - 1])
        self._report_bad(chunk, before=last)
        self._state["line"] = last + 1
      if self._row == len(chunk["line"]) and have < self.local_batch_size:
        self._report_bad(chunk, before=None)
        self._chunk = next(self._chunks, None)
        self._row = self._bad_row = 0
    self._state["position"] += 1
    return self._cut(parts)

  def chunks(self):
    """Every row of one pass, in chunks of columns (``criteo_chunks.parse_chunk``'s).

    Malformed lines are counted and reported as by batches; the reader's
    position is left alone. The binary converter writes from these.
    """
    self.close()
    stream = criteo_chunks.grain_stream(
        self._refs, self._settings, epoch=0, skip_before=0, num_epochs=1,
        workers=self.workers) if self.workers else criteo_chunks.stream(
            self.paths, self._settings, epoch=0, skip_before=0, num_epochs=1)
    try:
      for chunk in stream:
        self._bad_row = 0
        self._report_bad(chunk, before=None)
        yield chunk
    finally:
      if hasattr(stream, "close"):
        stream.close()

  def _report_bad(self, chunk: dict, before: int | None) -> None:
    """Counts the chunk's malformed lines up to global line ``before`` (all: None), in order."""
    bad = chunk["bad"]
    while self._bad_row < len(bad) and (before is None or bad[self._bad_row][0] < before):
      _, path, number, reason = bad[self._bad_row]
      self._bad_row += 1
      self._bad(path, number, reason)

  def _cut(self, parts: list) -> dict:
    def join(key):
      pieces = [chunk[key][lo:hi] for chunk, lo, hi in parts]
      return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    ids = join("ids")
    sparse = {f.name: np.ascontiguousarray(ids[:, i]) for i, f in enumerate(self.spec.features)}
    return {"dense": join("dense"), "sparse": sparse, "label": join("label")}

  def _bad(self, path: str, number: int, reason: str) -> None:
    if not self.bad_lines.add(path, number, reason):
      return  # counted and logged on an earlier epoch
    count, limit = self.bad_lines.count, self.max_bad_lines
    if limit is not None and count > limit:
      raise CriteoFormatError(
          f"{path}:{number}: {reason}. Fix or remove the line, or allow up to N malformed "
          f"lines with max_bad_lines=N (--config.data.max_bad_lines=N; -1 skips them all); "
          f"max_bad_lines={limit}, malformed so far: {count}."
      )
    if count <= MAX_REPORTED:
      log.warning("%s:%d: %s; skipped (malformed line %d, max_bad_lines=%s)%s", path, number,
                  reason, count, "none" if limit is None else limit,
                  "; later ones are counted, not logged" if count == MAX_REPORTED else "")

  def assemble(self, rows: list) -> dict:
    """A batch of ``parse_line`` results, hashed as this reader hashes (``train.predict``)."""
    n = len(rows)
    cats = np.array([r[2] for r in rows], np.int64).reshape(n, CRITEO_NUM_SPARSE)
    ids = to_ids(cats, self._salts, self._buckets, self.raw_ids)
    return {
        "dense": to_dense(np.array([r[1] for r in rows], np.float64).reshape(n, CRITEO_NUM_DENSE)),
        "sparse": {f.name: ids[:, i].copy() for i, f in enumerate(self.spec.features)},
        "label": np.array([r[0] for r in rows], np.float32),
    }
