"""Multi-hashing of entity ids into one table: k rows per id, row 0 for padding.

A feed has hundreds of millions of users and items, far more than a table
can hold a row for. Each id is hashed by ``k`` independent functions of the
universal family

    h_j(id) = ((id * a_j + b_j) mod p) mod (num_buckets - 1) + 1,    j < k,

into the rows ``1 .. num_buckets - 1`` of one shared table; row 0 is reserved
for padding (ids < 0). Two ids share all ``k`` rows with probability about
``(num_buckets - 1) ** -k``, so a model that combines the ``k`` rows
(``embedlib.models.MultiHashEmbed``) tells almost all ids apart with a table
far smaller than the id space. ``hash_collisions`` measures how many ids share
rows, against what uniform hashing predicts.

The hashes run on the host in numpy ``uint64`` arithmetic, and are exact:
``p = 2**61 - 1`` (a Mersenne prime), so distinct ids below ``2**61`` stay
distinct mod ``p`` (a smaller prime would make every id pair that agrees mod
``p`` share all ``k`` rows: for a million 40-bit ids and ``p < 2**32``,
about 230 of them), and the 122-bit products are reduced exactly in 32-bit
limbs (``_mulmod``). The coefficients ``1 <= a_j < p``, ``0 <= b_j < p``
follow from ``seed`` alone (splitmix64), so every host, process and device
count computes the same rows, and the device sees only int32 row numbers.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from embedlib.data import _hashing
from embedlib.data.spec import MAX_ROWS

#: The prime modulus, 2**61 - 1 (see the module docstring).
PRIME = (1 << 61) - 1
_P = np.uint64(PRIME)
_LOW32 = np.uint64(0xFFFFFFFF)
#: Most hash functions per id; past a few, each more adds rows to look up
#: but almost no distinguishing power.
MAX_HASHES = 16
#: The row padding ids (< 0) map to.
PAD_ROW = 0


@dataclasses.dataclass(frozen=True)
class MultiHash:
  """``num_hashes`` hash functions of ids into rows 1 to ``num_buckets - 1``.

  >>> h = MultiHash(num_buckets=1000, num_hashes=2, seed=0)
  >>> rows = h(np.array([7, 7, 123456789012, -1]))
  >>> rows.shape, rows.dtype.name
  ((4, 2), 'int32')
  >>> bool((rows[0] == rows[1]).all()), rows[3].tolist()  # deterministic; -1 pads
  (True, [0, 0])
  >>> bool(((rows[:3] >= 1) & (rows[:3] < 1000)).all())
  True

  Attributes:
    num_buckets: rows of the table, row 0 (padding) included; at least 2.
    num_hashes: hash functions ``k``, 1 to ``MAX_HASHES``.
    seed: chooses the functions; two tables hashed with different seeds
      collide independently.
    name: the config key or feature, for error messages.
  """

  num_buckets: int
  num_hashes: int = 2
  seed: int = 0
  name: str = "multi_hash"

  def __post_init__(self):
    for field, low in (("num_buckets", 2), ("num_hashes", 1)):
      value = getattr(self, field)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(
            f"{self.name}.{field} must be an int >= {low}, got {value!r}"
            + ("; row 0 is reserved for padding, so a table needs 2 rows or more."
               if field == "num_buckets" else "; use 1 for plain hashing, 2-4 for multi-hashing."))
    if self.num_buckets > MAX_ROWS:
      raise ValueError(f"{self.name}.num_buckets={self.num_buckets} is more rows than int32 "
                       f"can address (at most {MAX_ROWS}); use fewer buckets.")
    if self.num_hashes > MAX_HASHES:
      raise ValueError(f"{self.name}.num_hashes={self.num_hashes}: at most {MAX_HASHES} hash "
                       "functions; 2-4 already tell almost all ids apart.")
    if self.num_hashes > self.num_buckets - 1:
      raise ValueError(
          f"{self.name}.num_hashes={self.num_hashes} exceeds the "
          f"{self.num_buckets - 1} rows an id can hash to (num_buckets - 1); "
          f"raise num_buckets or use fewer hashes.")

  @property
  def coefficients(self) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)``: uint64 ``[num_hashes]`` each, ``1 <= a < p``, ``0 <= b < p``."""
    a = [1 + _hashing.derive_key(self.seed, "multi_hash_a", j) % (PRIME - 1)
         for j in range(self.num_hashes)]
    b = [_hashing.derive_key(self.seed, "multi_hash_b", j) % PRIME
         for j in range(self.num_hashes)]
    return np.array(a, np.uint64), np.array(b, np.uint64)

  def __call__(self, ids) -> np.ndarray:
    """Rows of ``ids``: int32 ``ids.shape + (num_hashes,)``; ids < 0 give row 0.

    Args:
      ids: integer ids of any shape (numpy, list or int), int8 to uint64.
    """
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
      raise ValueError(f"{self.name}: ids must be integers, got {ids.dtype}; hash strings "
                       "to integers first.")
    pad = ids < 0 if ids.dtype.kind == "i" else np.zeros(ids.shape, bool)
    x = np.where(pad, 0, ids).astype(np.uint64) % _P
    a, b = self.coefficients
    h = _reduce(_mulmod(x[..., None], a) + b)
    rows = (h % np.uint64(self.num_buckets - 1) + np.uint64(1)).astype(np.int32)
    return np.where(pad[..., None], np.int32(PAD_ROW), rows)


def _reduce(s: np.ndarray) -> np.ndarray:
  """``s mod p`` for ``s < 2**63`` (``2**61 = 1 mod p``)."""
  s = (s & _P) + (s >> np.uint64(61))
  s = (s & _P) + (s >> np.uint64(61))
  return np.where(s >= _P, s - _P, s)


def _mulmod(x: np.ndarray, a: np.ndarray) -> np.ndarray:
  """``x * a mod p`` for ``x, a < p``, exact in uint64 (32-bit limbs)."""
  x_hi, x_lo = x >> np.uint64(32), x & _LOW32
  a_hi, a_lo = a >> np.uint64(32), a & _LOW32
  # x * a = hi 2**64 + mid 2**32 + lo, and 2**64 = 8, 2**61 = 1 (mod p).
  hi = x_hi * a_hi                        # < 2**58
  mid = x_hi * a_lo + x_lo * a_hi         # < 2**62
  lo = x_lo * a_lo                        # < 2**64
  mid = (mid >> np.uint64(29)) + ((mid & np.uint64((1 << 29) - 1)) << np.uint64(32))
  lo = (lo >> np.uint64(61)) + (lo & _P)
  return _reduce(_reduce(hi << np.uint64(3)) + _reduce(mid) + lo)


def hash_collisions(hasher: MultiHash, ids) -> dict:
  """How many of ``ids`` share rows, observed against uniform hashing's expectation.

  >>> ids = np.random.default_rng(0).integers(0, 2**40, 1000)
  >>> r = hash_collisions(MultiHash(1001, 2), ids)
  >>> r["ids"], r["rows"], round(r["per_hash_expected"]), r["per_hash_observed"]
  (1000, 1000, 632, 634.0)
  >>> round(r["all_hashes_expected"], 2), r["all_hashes_observed"]   # one pair expected
  (1.0, 2)

  Structured ids (consecutive ones) usually collide less than the uniform
  expectation: the functions are linear.

  Args:
    hasher: the hash functions.
    ids: ids; duplicates and negative (padding) ids are dropped first.

  Returns:
    ``ids``: distinct ids, ``rows``: rows they hash to (``num_buckets - 1``);
    ``per_hash_expected`` / ``per_hash_observed``: ids sharing their row with
    another id under one hash function (expected: ``n (1 - (1 - 1/m)**(n-1))``;
    observed: the mean over the functions); ``all_hashes_expected`` /
    ``all_hashes_observed``: ids sharing all ``k`` rows (the same ordered
    tuple) with another id, whom a model can't tell apart.
  """
  ids = np.unique(np.asarray(ids).reshape(-1))
  if ids.dtype.kind == "i":
    ids = ids[ids >= 0]
  n, m, k = ids.size, hasher.num_buckets - 1, hasher.num_hashes
  rows = hasher(ids)  # [n, k]

  def shared(keys) -> int:
    _, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    return int((counts[inverse.reshape(-1)] > 1).sum())

  expect = lambda p: n * -math.expm1((n - 1) * math.log1p(-p)) if n > 1 else 0.0
  return {
      "ids": int(n),
      "rows": int(m),
      "per_hash_expected": expect(1.0 / m),
      "per_hash_observed": float(np.mean([shared(rows[:, j]) for j in range(k)])) if n else 0.0,
      "all_hashes_expected": expect(float(m) ** -k),
      "all_hashes_observed": shared(rows) if n else 0,
  }
