"""Ids of a table's columns as 64-bit values: the one function training and serving share.

**The id of a value** (``raw_ids``):

- an integer id is its own 64-bit two's complement (``-1`` is therefore
  the padding id, which reads as missing: a row of zeros, never admitted);
- a string id is the first 8 bytes, read little-endian, of the BLAKE2b
  digest (``hashlib.blake2b(value.encode("utf-8"), digest_size=8)``) of its
  UTF-8 bytes; the one value that would land on the padding id
  (``2**64 - 1``) is moved to ``2**64 - 2``;
- a null, with no default, is ``MISSING``.

A dynamic table (``embedlib.DynamicEmbed``) takes these ids as they are; a
hashed table takes row ``1 + mix(id ^ salt) % (num_embeddings - 1)``, where
``mix`` is splitmix64's finaliser and ``salt`` a key of the column's name
(row 0 is the missing id's). Python's own ``hash`` is salted per process
and is never used. Nothing here imports jax.

>>> int(string_ids(["alice"])[0]) == int.from_bytes(
...     __import__("hashlib").blake2b(b"alice", digest_size=8).digest(), "little")
True
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embedlib.data import _hashing

#: The id of a null id value without a default (as Criteo's raw missing value).
MISSING = np.uint64(1 << 60)
#: The padding id (``-1`` as uint64): read as missing, a zero row.
PAD = np.uint64((1 << 64) - 1)


def string_id(value: str) -> int:
  """The 64-bit id of one string (see the module docstring)."""
  h = int.from_bytes(hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest(), "little")
  return h - 1 if h == (1 << 64) - 1 else h


def string_ids(values) -> np.ndarray:
  """uint64 ids of a sequence of strings (each distinct value hashed once).

  >>> string_ids(["a", "b", "a"]).tolist()[0] == string_ids(["a"]).tolist()[0]
  True
  """
  array = pa.array(values, pa.string()) if not isinstance(values, (pa.Array,
                                                                   pa.ChunkedArray)) else values
  return _string_ids(array)


def _string_ids(array) -> np.ndarray:
  """Ids of an Arrow string array (nulls: ``MISSING``)."""
  unique = pc.unique(array)
  table = np.fromiter((MISSING if v is None else string_id(v) for v in unique.to_pylist()),
                      np.uint64, len(unique))
  index = pc.index_in(array, value_set=unique, skip_nulls=False)
  return table[np.asarray(index.to_numpy(zero_copy_only=False), np.int64)]


def raw_ids(array: pa.Array) -> np.ndarray:
  """uint64 ids of an Arrow int or string array; nulls are ``MISSING``.

  >>> raw_ids(pa.array([7, None, -1])).tolist() == [7, int(MISSING), 2**64 - 1]
  True
  """
  if isinstance(array, pa.ChunkedArray):
    array = array.combine_chunks()
  if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
    return _string_ids(array)
  filled = pc.fill_null(array.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
  out = np.asarray(filled, np.int64).view(np.uint64).copy()
  if array.null_count:
    out[np.asarray(array.is_null().to_numpy(zero_copy_only=False), bool)] = MISSING
  return out


def column_salt(name: str) -> np.uint64:
  """The hashed table's salt of column ``name`` (stable across processes and runs)."""
  return np.uint64(_hashing.derive_key("tabular", name))


def hashed_rows(ids: np.ndarray, name: str, num_embeddings: int) -> np.ndarray:
  """int32 rows ``1 .. num_embeddings - 1`` of uint64 ids; ``MISSING`` and ``PAD`` read row 0.

  >>> hashed_rows(np.array([5, MISSING], np.uint64), "c", 10).tolist()[1]
  0
  """
  rows = _hashing.mix(ids ^ column_salt(name)) % np.uint64(num_embeddings - 1) + np.uint64(1)
  rows = rows.astype(np.int32)
  rows[(ids == MISSING) | (ids == PAD)] = 0
  return rows
