"""Stable 64-bit hashing (splitmix64) shared by the synthetic source and Criteo.

Python's ``hash`` is salted per process, so ids hashed with it would differ
between hosts and between runs; these functions depend on their inputs only.
numpy uint64 arithmetic wraps silently on arrays, which is what we want.
"""

from __future__ import annotations

import zlib

import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser on a uint64 array (a new array).

  >>> mix(np.array([0, 1], np.uint64))[1]
  np.uint64(6238072747940578789)
  """
  return _mix_inplace(np.array(x, np.uint64))


def _mix_inplace(x: np.ndarray) -> np.ndarray:
  x ^= x >> _S30
  x *= _M1
  x ^= x >> _S27
  x *= _M2
  x ^= x >> _S31
  return x


def mix_int(x: int) -> int:
  """``mix`` on one Python int, for deriving keys without numpy scalar overflow warnings.

  >>> mix_int(1) == int(mix(np.array([1], np.uint64))[0])
  True
  """
  x &= _MASK
  x ^= x >> 30
  x = (x * 0xBF58476D1CE4E5B9) & _MASK
  x ^= x >> 27
  x = (x * 0x94D049BB133111EB) & _MASK
  return x ^ (x >> 31)


def derive_key(*parts: int | str) -> int:
  """A 64-bit key from ints and strings (strings through crc32, which is stable).

  >>> derive_key(0, "train") != derive_key(0, "eval")
  True
  """
  key = 0
  for part in parts:
    value = zlib.crc32(part.encode()) if isinstance(part, str) else int(part)
    key = mix_int(key ^ mix_int(value + _GOLDEN))
  return key


def hash_u64(key: int | np.ndarray, counter: np.ndarray) -> np.ndarray:
  """``mix(key + counter * golden)``: independent 64-bit draws per (key, counter).

  Args:
    key: a 64-bit key, or a uint64 array broadcasting against ``counter``.
    counter: uint64 array (example index, row id, ...).

  Returns:
    uint64 array of the broadcast shape.

  >>> hash_u64(7, np.arange(3, dtype=np.uint64)).shape
  (3,)
  """
  x = np.asarray(counter, np.uint64) * np.uint64(_GOLDEN) + np.asarray(key, np.uint64)
  return _mix_inplace(x)


def uniform(bits: np.ndarray) -> np.ndarray:
  """float64 in the open interval (0, 1) from uint64 hash bits.

  >>> u = uniform(hash_u64(1, np.arange(1000, dtype=np.uint64)))
  >>> bool(0 < u.min() and u.max() < 1)
  True
  """
  return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def normal(bits: np.ndarray) -> np.ndarray:
  """Standard normal float64 from uint64 hash bits (Box-Muller on the two halves).

  >>> z = normal(hash_u64(1, np.arange(100_000, dtype=np.uint64)))
  >>> bool(abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02)
  True
  """
  hi = ((bits >> np.uint64(32)).astype(np.float64) + 0.5) * (1.0 / (1 << 32))
  lo = ((bits & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) * (1.0 / (1 << 32))
  return np.sqrt(-2.0 * np.log(hi)) * np.cos(2.0 * np.pi * lo)
