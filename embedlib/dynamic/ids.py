"""Raw ids as two uint32 words, and the hashes that place them in buckets.

JAX with x64 off holds no 64-bit integer, so a raw id travels as a
``[..., 2]`` uint32 array of words ``(hi, lo)``: the id's two's-complement
64-bit pattern, split on the host in full precision (``words``) or, for
device arrays of 32-bit ids, extended in the graph (``device_words``:
signed dtypes sign-extend, unsigned zero-extend). Every hash here runs on
those words with uint32 arithmetic only, so numpy and JAX agree bit for bit
whatever the x64 flag says.

The all-ones pattern (``-1`` of any signed dtype, ``2**64 - 1``) is
padding: it is never admitted, reads zeros and carries no gradient.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

PAD_WORD = 0xFFFFFFFF
ID_DTYPES = ("int32", "uint32", "int64", "uint64")
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35
BUCKET_SEED = 0x9E3779B9


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Words:
  """Raw ids as words: ``value`` is uint32 ``[..., 2]`` (hi, lo).

  A pytree, so it passes through ``jax.jit`` and ``nnx.jit``; build it on
  the host with ``words(ids)``.
  """

  value: jax.Array

  @property
  def shape(self):
    return tuple(self.value.shape[:-1])

  @property
  def hi(self):
    return self.value[..., 0]

  @property
  def lo(self):
    return self.value[..., 1]

  def tree_flatten(self):
    return (self.value,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(*children)


def _range(dtype: str):
  info = np.iinfo(np.dtype(dtype))
  return int(info.min), int(info.max)


def host_words(ids, *, id_dtype: str | None = None, name: str = "dynamic") -> np.ndarray:
  """Host ids of any integer dtype to uint32 ``[..., 2]`` words, exactly.

  With ``id_dtype`` None any 64-bit pattern is an id (an int64 ``-5`` is
  the uint64 ``2**64 - 5``); else every value must lie in ``id_dtype``'s
  range or be the padding id (``-1``, or ``2**64 - 1``).

  >>> host_words(np.array([2**40 + 3, -1]), name="t").tolist()
  [[256, 3], [4294967295, 4294967295]]
  """
  arr = np.asarray(ids)
  if arr.dtype == object:
    raise ValueError(
        f"{name}: raw ids {ids!r} do not fit a 64-bit integer; DynamicEmbed takes "
        "ids of at most 64 bits (declare id_dtype='uint64' and pass numpy uint64).")
  _check_integer(arr.dtype, name)
  lo_ok, hi_ok = _range(id_dtype) if id_dtype is not None else (-2**63, 2**64 - 1)
  if arr.size:
    if np.issubdtype(arr.dtype, np.signedinteger):
      wide = arr.astype(np.int64)
      lo64, hi64 = max(lo_ok, -2**63), min(hi_ok, 2**63 - 1)
      bad = ~((wide == -1) | ((wide >= lo64) & (wide <= hi64)))
      u = np.asarray(wide).view(np.uint64)
    else:
      u = arr.astype(np.uint64)
      pad = u == np.uint64(2**64 - 1)
      bad = (u > np.uint64(hi_ok)) & ~pad
    if np.any(bad):
      first = arr.reshape(-1)[np.flatnonzero(bad.reshape(-1))[0]]
      raise ValueError(
          f"{name}: raw id {int(first)} lies outside the table's id_dtype={id_dtype!r} "
          f"(range [{lo_ok}, {hi_ok}], -1 is padding); declare a wider id_dtype "
          "when building the DynamicEmbed, or fix the ids.")
  else:
    u = arr.astype(np.uint64)
  u = np.asarray(u, np.uint64)
  return np.stack([(u >> np.uint64(32)).astype(np.uint32),
                   (u & np.uint64(PAD_WORD)).astype(np.uint32)], axis=-1)


def words(ids, *, id_dtype: str | None = None, name: str = "dynamic") -> Words:
  """Host ids to ``Words`` on the device (see ``host_words``)."""
  return Words(jnp.asarray(host_words(ids, id_dtype=id_dtype, name=name)))


def device_words(ids, *, name: str = "dynamic") -> Words:
  """Device ids of a 32-bit-or-narrower integer dtype to ``Words``, in the graph.

  Signed ids sign-extend (``-1`` stays padding), unsigned zero-extend.
  """
  _check_integer(ids.dtype, name)
  dtype = np.dtype(ids.dtype)
  if dtype.itemsize > 4:
    raise ValueError(
        f"{name}: device ids of dtype {dtype} (x64 on); pass 64-bit ids from the "
        "host as numpy arrays, or as dynamic.words(ids).")
  if np.issubdtype(dtype, np.signedinteger):
    wide = ids.astype(jnp.int32)
    hi = jnp.where(wide < 0, jnp.uint32(PAD_WORD), jnp.uint32(0))
    lo = jax.lax.bitcast_convert_type(wide, jnp.uint32)
  else:
    hi = jnp.zeros(ids.shape, jnp.uint32)
    lo = ids.astype(jnp.uint32)
  return Words(jnp.stack([hi, lo], axis=-1))


def _check_integer(dtype, name):
  dtype = np.dtype(dtype)
  if not np.issubdtype(dtype, np.integer) or dtype == np.bool_:
    raise TypeError(
        f"{name}: raw ids of dtype {dtype}; DynamicEmbed takes integer ids (cast "
        "float ids with ids.astype(np.int64) only if they hold exact integers).")


def fmix32(x, xp=jnp):
  """murmur3's 32-bit finaliser, in uint32 arithmetic (numpy or jnp)."""
  u32 = xp.uint32
  x = x ^ (x >> u32(16))
  x = x * u32(_M1)
  x = x ^ (x >> u32(13))
  x = x * u32(_M2)
  return x ^ (x >> u32(16))


def hash_words(hi, lo, seed: int, xp=jnp):
  """A 32-bit hash of the 64-bit id ``(hi, lo)``, the same in numpy and JAX."""
  u32 = xp.uint32
  h = fmix32(xp.asarray(hi, u32) ^ u32(seed), xp)
  return fmix32(h ^ xp.asarray(lo, u32) * u32(0x27D4EB2F), xp)


def bucket_of(hi, lo, num_buckets: int, xp=jnp):
  """The bucket (in ``[0, num_buckets)``) of each id, uint32 -> int32."""
  return (hash_words(hi, lo, BUCKET_SEED, xp) % xp.uint32(num_buckets)).astype(xp.int32)


def sketch_cell(hi, lo, row: int, width: int, xp=jnp):
  """The count-min sketch cell of each id in sketch row ``row``."""
  return (hash_words(hi, lo, 0x5BD1E995 + 0x1000193 * (row + 1), xp)
          % xp.uint32(width)).astype(xp.int32)
