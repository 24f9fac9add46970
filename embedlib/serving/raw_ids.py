"""Raw ids as the uint32 words a dynamic table's exported program takes, with numpy alone.

An artifact of a run with dynamic tables (``embedlib.DynamicEmbed``) takes
each raw-id input as ``[..., 2]`` uint32 words ``(hi, lo)``: the id's 64-bit
two's-complement pattern, split here on the host in full precision, so
numpy ``uint64`` / ``int64`` ids past ``2**32`` reach the program exactly
whatever jax's x64 flag says. The rule is ``embedlib.dynamic.ids.host_words``
(a test holds the two equal); it is restated here because that package
imports flax, which a server need not have. The all-ones pattern (``-1``
of a signed dtype, ``2**64 - 1``) is padding.

The map an artifact carries (``map_of``) is the table's own: per row, its
resident id's words and a score that is ``>= 0`` for a resident row.
"""

from __future__ import annotations

import numpy as np

PAD_WORD = 0xFFFFFFFF
ID_DTYPES = ("int32", "uint32", "int64", "uint64")


def id_range(id_dtype: str | None) -> tuple[int, int]:
  """The raw values ``id_dtype`` declares (None: any 64-bit pattern)."""
  if id_dtype is None:
    return -2**63, 2**64 - 1
  info = np.iinfo(np.dtype(id_dtype))
  return int(info.min), int(info.max)


def host_words(ids: np.ndarray, id_dtype: str | None = None) -> tuple[np.ndarray, int | None]:
  """Integer ids to uint32 ``ids.shape + (2,)`` words, exactly.

  Returns:
    ``(words, bad)``: ``bad`` is the first id outside ``id_dtype`` (padding
    excepted), or None; the caller names the input in its error.
  """
  arr = np.asarray(ids)
  lo_ok, hi_ok = id_range(id_dtype)
  bad = None
  if np.issubdtype(arr.dtype, np.signedinteger):
    wide = arr.astype(np.int64)
    out = (wide != -1) & ((wide < max(lo_ok, -2**63)) | (wide > min(hi_ok, 2**63 - 1)))
    u = wide.view(np.uint64)
  else:
    u = arr.astype(np.uint64)
    out = (u > np.uint64(hi_ok)) & (u != np.uint64(2**64 - 1))
  if out.any():
    bad = int(arr.reshape(-1)[np.flatnonzero(out.reshape(-1))[0]])
  words = np.stack([(u >> np.uint64(32)).astype(np.uint32),
                    (u & np.uint64(PAD_WORD)).astype(np.uint32)], axis=-1)
  return words, bad


def padding(shape) -> np.ndarray:
  """Padding ids' words, uint32 ``shape + (2,)``."""
  return np.full((*shape, 2), PAD_WORD, np.uint32)


def map_of(keys_hi, keys_lo, score) -> dict[int, int]:
  """A table's id -> row map from its map arrays: every resident raw id (uint64 value)."""
  hi, lo, score = (np.asarray(a) for a in (keys_hi, keys_lo, score))
  rows = np.flatnonzero(score >= 0)
  values = (hi[rows].astype(np.uint64) << np.uint64(32)) | lo[rows].astype(np.uint64)
  return dict(zip((int(v) for v in values), (int(r) for r in rows)))
