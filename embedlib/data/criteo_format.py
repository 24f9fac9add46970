"""The Criteo TSV line format: fields, parsing, the hold-out split, ids.

Shared by ``CriteoReader`` (in-process or in worker processes) and the
binary converter (``embedlib.data.criteo_binary``), so that every path turns
a line into the same row. See ``embedlib.data.criteo`` for the layout.
"""

from __future__ import annotations

import re

import numpy as np

from embedlib.data import _hashing

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26
_NUM_FIELDS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_SPARSE
GZIP_MAGIC = b"\x1f\x8b"
_INTEGER = re.compile(r"-?[0-9]+")
#: Resolution of the hold-out fraction: a line is held out when its hash mod this is below it.
HOLDOUT_BUCKETS = 1 << 20
_HOLDOUT_SALT = _hashing.derive_key("criteo", "holdout")
#: The raw id of a missing categorical value with ``raw_ids=True``.
MISSING_RAW = 1 << 60


class CriteoFormatError(ValueError):
  """Criteo data that can't be read: a malformed line beyond ``max_bad_lines``, a
  ``.gz`` file that isn't gzip or is truncated, or too few lines for a batch."""


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



def in_split(indices: np.ndarray, holdout_below: int, split: str) -> np.ndarray:
  """Which global line indices belong to ``split`` (a bool array).

  >>> in_split(np.arange(4), 0, "train").tolist()
  [True, True, True, True]
  >>> a, b = in_split(np.arange(1000), 100_000, "train"), in_split(np.arange(1000), 100_000, "holdout")
  >>> bool((a ^ b).all()), 50 < int(b.sum()) < 150
  (True, True)
  """
  indices = np.asarray(indices)
  if not holdout_below:
    return np.ones(indices.shape, bool)
  bits = _hashing.mix(indices.astype(np.uint64) ^ np.uint64(_HOLDOUT_SALT))
  held_out = bits % np.uint64(HOLDOUT_BUCKETS) < np.uint64(holdout_below)
  return held_out == (split == "holdout")


def to_ids(cats: np.ndarray, salts: np.ndarray, buckets: np.ndarray, raw_ids: bool) -> np.ndarray:
  """Categorical values (``[n, 26]`` int64, -1 missing) to a batch's ids.

  Hashed (``raw_ids=False``): int32 rows ``1 .. buckets`` by a per-feature
  salted splitmix64, 0 for missing. Raw: the int64 values, ``MISSING_RAW``
  for missing.
  """
  missing = cats < 0
  if raw_ids:
    return np.where(missing, np.int64(MISSING_RAW), cats)
  values = np.maximum(cats, 0).astype(np.uint64)
  ids = _hashing.mix(values ^ salts) % buckets + np.uint64(1)
  return np.where(missing, 0, ids).astype(np.int32)


def to_dense(ints: np.ndarray) -> np.ndarray:
  """The integer features (``[n, 13]``) as float32 ``log1p(max(x, 0))``."""
  return np.log1p(np.maximum(np.asarray(ints, np.float64), 0.0)).astype(np.float32)


# The usual line, which parse_line accepts with the same values: a 0/1 label,
# integers of at most 18 digits (always within 64 bits), hex of at most 15.
_USUAL_LINE = re.compile(rb"[01](?:\t(?:-?[0-9]{1,18})?){13}(?:\t[0-9a-fA-F]{0,15}){26}\r?\n?")


def parse_usual(raw: bytes) -> tuple[int, list[int], list[int]] | None:
  """``parse_line`` of a raw line, faster, for the usual lines; None for any other.

  A line this returns None for goes through ``parse_line``, which reads it
  or says what is wrong with it.

  >>> line = ("1\\t5\\t\\t-3" + "\\t" * 10 + "\\t68fd1e64" + "\\t" * 25).encode()
  >>> parse_usual(line) == parse_line(line.decode()), parse_usual(b"2\\tx")
  (True, None)
  """
  if _USUAL_LINE.fullmatch(raw) is None:
    return None
  fields = raw.rstrip(b"\r\n").split(b"\t")
  return (int(fields[0]), [int(x) if x else 0 for x in fields[1:1 + CRITEO_NUM_DENSE]],
          [int(x, 16) if x else -1 for x in fields[1 + CRITEO_NUM_DENSE:]])
