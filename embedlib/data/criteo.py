"""Reader for the Criteo display-advertising TSV layout (plain or .gz).

Each line holds 40 tab-separated fields: the 0/1 label, 13 integer features
``I1..I13`` and 26 categorical features ``C1..C26`` as hex strings (e.g.
``68fd1e64``). Any feature may be empty.

* Integer features become ``log1p(max(x, 0))`` (float32), the customary
  transform for these heavy-tailed counts; empty means 0.
* Categorical values are hashed with a stable per-feature-salted splitmix64
  into rows ``1 .. num_embeddings - 1``; **row 0 is reserved for "missing"**,
  so a model learns one embedding for absent values.
* Batches have a fixed size: a last partial batch (per epoch) is dropped and
  counted in ``dropped_examples``.
* Process ``p`` of ``n`` reads the lines whose 0-based index across all the
  files is ``p (mod n)``; with no malformed lines, process batches ``k`` of all
  processes together hold exactly the lines of the 1-process batch ``k``.
* Malformed lines are reported as ``path:line: reason``; ``max_bad_lines``
  chooses between skipping (up to a bound) and stopping at the first.

Lines are parsed with ``str.split`` and ``int``; nothing is evaluated or
unpickled from the files.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
from collections.abc import Iterator, Sequence

import numpy as np

from embedlib.data import _hashing
from embedlib.data.spec import DataSpec, SparseFeature

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
_NUM_FIELDS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_SPARSE
#: How many malformed lines ``BadLines`` keeps for the report.
MAX_REPORTED = 10


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
  """A malformed line beyond the reader's ``max_bad_lines`` tolerance."""


@dataclasses.dataclass
class BadLines:
  """Malformed lines seen by this process: a total and the first few.

  >>> bad = BadLines(); bad.add("a.tsv", 3, "label must be 0 or 1, got '2'")
  >>> print(bad)
  1 malformed line(s); first: a.tsv:3: label must be 0 or 1, got '2'
  """

  count: int = 0
  first: list = dataclasses.field(default_factory=list)  # [(path, line, reason)]

  def add(self, path: str, line: int, reason: str) -> None:
    self.count += 1
    if len(self.first) < MAX_REPORTED:
      self.first.append((path, line, reason))

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
    try:
      ints.append(int(field) if field else 0)
    except ValueError:
      raise ValueError(f"integer feature I{i + 1} is not an integer: {field!r}") from None
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

  Raises:
    FileNotFoundError: at construction, naming a path that does not exist.
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
  ):
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
      raise ValueError("CriteoReader needs at least one path.")
    self.paths = [os.fspath(p) for p in paths]
    for path in self.paths:
      if not os.path.isfile(path):
        raise FileNotFoundError(
            f"Criteo data file {path!r} does not exist (or is not a file); pass the path "
            "of a .tsv or .tsv.gz file in the Criteo layout."
        )
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
          raise ValueError(
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
    return self._assemble(rows)

  def _read(self, epoch: int, start_line: int):
    """Yields ``(global line index, parsed)`` of this process's lines from ``start_line``."""
    del epoch  # every epoch reads the same lines in the same order
    index = 0
    for path in self.paths:
      opener = gzip.open if path.endswith(".gz") else open
      with opener(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
          index += 1
          if index - 1 < start_line or (index - 1) % self.process_count != self.process_index:
            continue
          try:
            parsed = parse_line(raw.decode("ascii"))
          except (ValueError, UnicodeDecodeError) as e:
            reason = "not ASCII text" if isinstance(e, UnicodeDecodeError) else str(e)
            self._bad(path, number, reason)
            continue
          yield index - 1, parsed

  def _bad(self, path: str, number: int, reason: str) -> None:
    self.bad_lines.add(path, number, reason)
    if self.max_bad_lines is not None and self.bad_lines.count > self.max_bad_lines:
      raise CriteoFormatError(
          f"{path}:{number}: {reason}. Fix or remove the line, or pass "
          f"max_bad_lines=N to skip up to N malformed lines (None skips all); "
          f"max_bad_lines={self.max_bad_lines}, malformed so far: {self.bad_lines.count}."
      )

  def _assemble(self, rows: list) -> dict:
    labels = np.array([r[0] for r in rows], np.float32)
    ints = np.array([r[1] for r in rows], np.float64)
    dense = np.log1p(np.maximum(ints, 0.0)).astype(np.float32)
    cats = np.array([r[2] for r in rows], np.int64)
    missing = cats < 0
    values = np.maximum(cats, 0).astype(np.uint64)
    ids = _hashing.mix(values ^ self._salts) % self._buckets + np.uint64(1)
    ids = np.where(missing, 0, ids).astype(np.int32)
    sparse = {f.name: ids[:, i].copy() for i, f in enumerate(self.spec.features)}
    return {"dense": dense, "sparse": sparse, "label": labels}
