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
  lines of the 1-process batch ``k``.
* ``holdout`` sets aside a fraction of the lines for evaluation, chosen by a
  hash of the line's index: ``split="train"`` skips them and
  ``split="holdout"`` reads only them, so the two never share a line.
* Malformed lines are reported as ``path:line: reason`` (logged, the first
  ``MAX_REPORTED``) and counted once however many epochs read them;
  ``max_bad_lines`` chooses between skipping (up to a bound) and stopping at
  the first. A ``.gz`` file that is not gzip data is refused at
  construction; one that is truncated or corrupt stops the reader at the
  line where its data breaks.

Lines are parsed with ``str.split`` and ``int``; nothing is evaluated or
unpickled from the files.
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import os
import re
import zlib
from collections.abc import Iterator, Sequence

import numpy as np

from embedlib.data import _hashing
from embedlib.data.spec import DataSpec, SparseFeature

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
_NUM_FIELDS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_SPARSE
#: How many malformed lines ``BadLines`` keeps for the report (and the reader logs).
MAX_REPORTED = 10
_GZIP_MAGIC = b"\x1f\x8b"
_INTEGER = re.compile(r"-?[0-9]+")
#: Resolution of the hold-out fraction: a line is held out when its hash mod this is below it.
_HOLDOUT_BUCKETS = 1 << 20
_HOLDOUT_SALT = _hashing.derive_key("criteo", "holdout")
#: The raw id of a missing categorical value with ``raw_ids=True``.
MISSING_RAW = 1 << 60

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


class CriteoFormatError(ValueError):
  """Criteo data that can't be read: a malformed line beyond ``max_bad_lines``, a
  ``.gz`` file that isn't gzip or is truncated, or too few lines for a batch."""


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


def parse_line(text: str) -> tuple[int, list[int], list[int]]:
  """One Criteo line to ``(label, 13 ints, 26 categorical values or -1)``.

  >>> parse_line("1\\t5\\t\\t-3" + "\\t" * 10 + "\\t68fd1e64" + "\\t" * 25)[0:2]
  (1, [5, 0, -3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])

  Raises:
    ValueError: with the reason, when the line is malformed.
  """
  fields = text.rstrip("\r\n").split("\t")
  if len(fields) != _NUM_FIELDS:
    raise ValueError(f"expected {_NUM_FIELDS} tab-separated fields, got {len(fields)}")
  if fields[0] not in ("0", "1"):
    raise ValueError(f"label must be 0 or 1, got {fields[0]!r}")
  ints = []
  for i, field in enumerate(fields[1 : 1 + CRITEO_NUM_DENSE]):
    # Criteo writes an optional "-" and ASCII digits; int() would also take
    # "1_000", " 7 ", "+3" and non-ASCII digits, none of which a real file holds.
    if field and not _INTEGER.fullmatch(field):
      raise ValueError(f"integer feature I{i + 1} is not an integer (an optional '-' and "
                       f"ASCII digits): {field!r}")
    value = int(field) if field else 0
    if not -(1 << 63) <= value < (1 << 63):
      raise ValueError(f"integer feature I{i + 1} does not fit in 64 bits: {field!r}")
    ints.append(value)
  cats = []
  for i, field in enumerate(fields[1 + CRITEO_NUM_DENSE :]):
    if not field:
      cats.append(-1)
      continue
    # isalnum() rejects the signs, spaces and underscores int(..., 16) accepts;
    # 15 digits keep values in int64 with -1 free for "missing".
    if len(field) > 15 or not field.isalnum():
      raise ValueError(f"categorical feature C{i + 1} is not a hex string of 1-15 digits: {field!r}")
    try:
      cats.append(int(field, 16))
    except ValueError:
      raise ValueError(f"categorical feature C{i + 1} is not hex: {field!r}") from None
  return int(fields[0]), ints, cats


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

  Raises:
    FileNotFoundError: at construction, naming a path that does not exist.
    IsADirectoryError: at construction, naming a path that is a directory.
    CriteoFormatError: at construction, for a ``.gz`` path that isn't gzip
      data (or a gzip file without ``.gz``); while reading, as described in
      the module docstring.
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
        gzipped = f.read(2) == _GZIP_MAGIC
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
    self._holdout_below = int(round(self.holdout * _HOLDOUT_BUCKETS))
    salts = [_hashing.derive_key("criteo", f.name) for f in spec.features]
    self._salts = np.array(salts, np.uint64)
    self._buckets = np.array([f.num_embeddings - 1 for f in spec.features], np.uint64)
    self.bad_lines = BadLines()
    self.dropped_examples = 0
    self._state = {"position": 0, "epoch": 0, "line": 0}
    self._lines = None

  # -- state -------------------------------------------------------------------

  @property
  def position(self) -> int:
    """Number of batches yielded so far (across epochs)."""
    return self._state["position"]

  def get_state(self) -> dict:
    """``{"position", "epoch", "line"}``: where the next batch starts."""
    return dict(self._state)

  def set_state(self, state: dict) -> None:
    """Resumes from ``get_state()``; ``{"position": k}`` alone replays k batches.

    A position-only state is the same on every process, so one number can
    resume all of them (at the cost of re-parsing their lines).
    """
    self._lines = None
    if "line" in state:
      self._state = {k: int(state[k]) for k in ("position", "epoch", "line")}
      return
    self._state = {"position": 0, "epoch": 0, "line": 0}
    for _ in range(int(state["position"])):
      next(self)

  # -- iteration -----------------------------------------------------------------

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self.num_epochs is not None and self._state["epoch"] >= self.num_epochs:
      raise StopIteration
    if self._lines is None:
      self._lines = self._read(self._state["epoch"], self._state["line"])
    rows = []
    # Set once this call starts an epoch from its first line: reaching that
    # epoch's end without returning means it holds less than one batch.
    whole_epoch = False
    while len(rows) < self.local_batch_size:
      item = next(self._lines, None)
      if item is None:  # end of an epoch: drop the partial batch
        self.dropped_examples += len(rows)
        rows = []
        epoch = self._state["epoch"] + 1
        self._state.update(epoch=epoch, line=0)
        if self.num_epochs is not None and epoch >= self.num_epochs:
          raise StopIteration
        if whole_epoch:
          raise CriteoFormatError(
              f"{self.paths} hold fewer than batch_size // process_count = "
              f"{self.local_batch_size} valid lines for process {self.process_index}; "
              "use a smaller batch_size or more data."
          )
        whole_epoch = True
        self._lines = self._read(epoch, 0)
        continue
      line_index, parsed = item
      rows.append(parsed)
      self._state["line"] = line_index + 1
    self._state["position"] += 1
    return self.assemble(rows)

  def _in_split(self, index: int) -> bool:
    if not self._holdout_below:
      return True
    held_out = _hashing.mix_int(index ^ _HOLDOUT_SALT) % _HOLDOUT_BUCKETS < self._holdout_below
    return held_out == (self.split == "holdout")

  def _read(self, epoch: int, start_line: int):
    """Yields ``(global line index, parsed)`` of this process's lines from ``start_line``."""
    del epoch  # every epoch reads the same lines in the same order
    index, kept = 0, 0  # lines seen, and lines of this split seen, across the files
    for path in self.paths:
      opener = gzip.open if path.endswith(".gz") else open
      number = 0
      try:
        with opener(path, "rb") as f:
          for number, raw in enumerate(f, start=1):
            index += 1
            if not self._in_split(index - 1):
              continue
            kept += 1
            if index - 1 < start_line or (kept - 1) % self.process_count != self.process_index:
              continue
            try:
              parsed = parse_line(raw.decode("ascii"))
            except (ValueError, UnicodeDecodeError) as e:
              reason = "not ASCII text" if isinstance(e, UnicodeDecodeError) else str(e)
              self._bad(path, number, reason)
              continue
            yield index - 1, parsed
      except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise CriteoFormatError(
            f"{path}:{number + 1}: the gzip data breaks off here ({e}); the file is truncated "
            "or corrupt: download or compress it again.") from None

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
    labels = np.array([r[0] for r in rows], np.float32)
    ints = np.array([r[1] for r in rows], np.float64)
    dense = np.log1p(np.maximum(ints, 0.0)).astype(np.float32)
    cats = np.array([r[2] for r in rows], np.int64)
    missing = cats < 0
    if self.raw_ids:
      raw = np.where(missing, MISSING_RAW, cats)
      sparse = {f.name: raw[:, i].copy() for i, f in enumerate(self.spec.features)}
      return {"dense": dense, "sparse": sparse, "label": labels}
    values = np.maximum(cats, 0).astype(np.uint64)
    ids = _hashing.mix(values ^ self._salts) % self._buckets + np.uint64(1)
    ids = np.where(missing, 0, ids).astype(np.int32)
    sparse = {f.name: ids[:, i].copy() for i, f in enumerate(self.spec.features)}
    return {"dense": dense, "sparse": sparse, "label": labels}
