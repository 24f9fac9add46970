"""Which rows train, which evaluate and which test: by a hash of the row, or by time.

- ``hash``: a row's number (across every file, ``files.Chunk``) hashed with
  the split's seed falls in ``[0, 1)``: below ``eval_fraction`` it
  evaluates, below ``eval_fraction + test_fraction`` it tests, the rest
  trains. RecBole's random 8:1:1 split is ``eval_fraction=0.1,
  test_fraction=0.1``.
- ``time``: rows before ``split_time`` train, the rest evaluate; with
  ``test_time`` (after ``split_time``), rows from ``test_time`` on test.
- ``files``: the training path's rows all train; an eval path (and a test
  path) hold the others (every part of a files split is every row).

The sequence tasks' leave-one-out split (each user's last row tests, the
one before evaluates) groups rows by user, so it is made where their
histories are (``embedlib.data.movielens``), not here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from embedlib.data import _hashing
from embedlib.tabular.schema import SchemaError

HASH, TIME, FILES = "hash", "time", "files"
KINDS = (HASH, TIME, FILES)
TRAIN, EVAL, TEST, ALL = "train", "eval", "test", "all"
PARTS = (TRAIN, EVAL, TEST, ALL)
_UNIT = 1 << 53


@dataclasses.dataclass(frozen=True)
class Split:
  """How rows are parted (see the module docstring).

  >>> s = Split(HASH, eval_fraction=0.1, test_fraction=0.1)
  >>> share = s.mask(TRAIN, np.arange(100_000), None).mean()
  >>> bool(abs(share - 0.8) < 0.01)
  True
  """

  kind: str = HASH
  eval_fraction: float = 0.1
  test_fraction: float = 0.0
  split_time: float = 0.0
  test_time: float = 0.0
  seed: int = 0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise SchemaError(f"config.data.split={self.kind!r}; use one of {KINDS}.")
    if self.kind == HASH:
      for key in ("eval_fraction", "test_fraction"):
        value = getattr(self, key)
        if not 0.0 <= value < 1.0:
          raise SchemaError(f"config.data.{key}={value}: a fraction in [0, 1).")
      if self.eval_fraction + self.test_fraction >= 1.0 or not self.eval_fraction:
        raise SchemaError(
            f"config.data.eval_fraction={self.eval_fraction}, test_fraction="
            f"{self.test_fraction}: eval_fraction must be > 0 and both together < 1, "
            "leaving rows to train on.")
    if self.kind == TIME and self.test_time and self.test_time <= self.split_time:
      raise SchemaError(f"config.data.test_time={self.test_time} must come after "
                        f"split_time={self.split_time} (or be 0: no test rows).")

  @property
  def has_test(self) -> bool:
    return (self.kind == HASH and self.test_fraction > 0) or (
        self.kind == TIME and self.test_time > 0)

  def mask(self, part: str, rows: np.ndarray, timestamps) -> np.ndarray:
    """Whether each row (its number across the files) is in ``part``.

    Args:
      part: ``train``, ``eval``, ``test`` or ``all``.
      rows: int64 row numbers.
      timestamps: float64 of each row, for a ``time`` split (else unused).
    """
    if part == ALL or self.kind == FILES:
      return np.ones(len(rows), bool)
    if self.kind == HASH:
      key = _hashing.derive_key("tabular-split", self.seed)
      u = (_hashing.hash_u64(key, np.asarray(rows, np.uint64)) >> np.uint64(11)).astype(
          np.float64) / _UNIT
      low = {TRAIN: self.eval_fraction + self.test_fraction, EVAL: 0.0,
             TEST: self.eval_fraction}[part]
      high = {TRAIN: 1.0, EVAL: self.eval_fraction,
              TEST: self.eval_fraction + self.test_fraction}[part]
      return (u >= low) & (u < high)
    t = np.asarray(timestamps, np.float64)
    end = self.test_time or np.inf
    if part == TRAIN:
      return t < self.split_time
    if part == EVAL:
      return (t >= self.split_time) & (t < end)
    return t >= end

  def describe(self) -> str:
    if self.kind == HASH:
      test = f", test {self.test_fraction:.0%}" if self.test_fraction else ""
      return (f"a hash of the row number (seed {self.seed}): eval {self.eval_fraction:.0%}"
              f"{test}, the rest trains")
    if self.kind == TIME:
      test = f", test from {self.test_time:g}" if self.test_time else ""
      return f"by time: train before {self.split_time:g}, eval after{test}"
    return "by file: the training path trains, the eval path evaluates"
