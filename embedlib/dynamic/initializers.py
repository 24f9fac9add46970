"""A dynamic table's default initializer: each value a hash of (key, row, column).

A step draws the initial value of every row it places again after an
eviction, tens of thousands of rows at a time. flax's default embedding
initializer (``default_embed_init``: normal, variance ``1 / features``)
costs a threefry hash and an inverse error function per value, and on a CPU
the inverse error function dominates the draw. ``HashedUniform`` instead
hashes each value's (key, row, column) with a few uint32 multiplies and
shifts and maps the hash to a uniform value of the same variance (TorchRec's
default is uniform too).

Its values are exact by construction: an odd integer below ``2**24`` (exact
in float32) times one constant, a single rounded multiply. So a row has the
same bits whichever program computes it (the table's creation, an in-line or
a pipelined step, the reference), on any device count and platform, with or
without the CPU kernels.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

_U32 = jnp.uint32


def mix32(x):
  """murmur3's 32-bit finalizer: a bijection of uint32 in which every output bit
  depends on every input bit.

  >>> int(mix32(jnp.uint32(1)))
  1364076727
  """
  x = x ^ (x >> _U32(16))
  x = x * _U32(0x85EBCA6B)
  x = x ^ (x >> _U32(13))
  x = x * _U32(0xC2B2AE35)
  return x ^ (x >> _U32(16))


def key_words(key_data):
  """Two uint32 words from a key's data (``jax.random.key_data``: ``[2]`` for threefry)."""
  words = jnp.asarray(key_data).astype(_U32).reshape(-1)
  k0, k1 = words[0], words[1 % words.shape[0]]
  for i in range(2, words.shape[0]):
    k0 = mix32(k0 ^ words[i])
  return k0, k1


def row_bits(key_data, rows, features: int):
  """uint32 ``rows.shape + (features,)``: the hash of (key, row, column) of each value.

  A row's words depend on its number alone, so any set of rows, drawn in
  any order or chunks, gives the values one draw of the whole table gives.
  """
  k0, k1 = key_words(key_data)
  r = mix32(jnp.asarray(rows).astype(_U32) ^ k0)
  c = mix32(mix32(jnp.arange(features, dtype=_U32) ^ k1) ^ k0)
  return mix32(r[..., None] ^ c)


@dataclasses.dataclass(frozen=True)
class HashedUniform:
  """Uniform in ``[-a, a]`` with variance ``scale / features``: a hash per value.

  The default ``embedding_init`` of ``DynamicEmbed``. ``scale=1`` gives
  the variance of flax's ``default_embed_init`` (normal with variance
  ``1 / features``), so ``a = sqrt(3 / features)``. Each value is
  ``row_bits``' top 24 bits as an odd integer ``k`` in ``(-2**24, 2**24)``
  times ``a / 2**24``: mean 0, and the same bits in every program.

  Row ``r`` of a table it draws is ``rows(key_data, [r], ...)``: it is a
  row initializer (``mapping.init_rows`` calls ``rows``), and called as a
  flax initializer it gives each row of ``shape[:-1]`` its index's values.

  >>> init = HashedUniform()
  >>> key = jax.random.key(0)
  >>> table = init(key, (6, 64))
  >>> bool(jnp.array_equal(table[4], init.rows(jax.random.key_data(key), jnp.array([4]),
  ...                                            64, jnp.float32)[0]))
  True
  >>> bool(jnp.abs(table).max() <= (3 / 64) ** 0.5)
  True
  """

  scale: float = 1.0

  def bound(self, features: int) -> float:
    """``a``: the values lie in ``[-a, a]``."""
    return math.sqrt(3.0 * self.scale / features)

  def step(self, features: int) -> float:
    """``a / 2**24``: each value is an odd integer ``k`` times this."""
    return self.bound(features) / (1 << 24)

  def rows(self, key_data, rows, features: int, dtype=jnp.float32):
    """``rows.shape + (features,)`` values of the rows numbered ``rows``."""
    bits = row_bits(key_data, rows, features)
    odd = ((bits >> _U32(7)) | _U32(1)).astype(jnp.int32) - (1 << 24)
    return (odd.astype(jnp.float32) * jnp.float32(self.step(features))).astype(dtype)

  def __call__(self, key, shape, dtype=jnp.float32):
    if len(shape) < 1:
      raise ValueError(f"HashedUniform draws rows of features: shape {shape} has no last axis.")
    key_data = (jax.random.key_data(key)
                if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key)
    rows = jnp.arange(math.prod(shape[:-1]), dtype=jnp.int32).reshape(shape[:-1])
    return self.rows(key_data, rows, shape[-1], dtype)


def is_row_init(init) -> bool:
  """Whether ``init`` draws rows by number itself (a ``rows(key_data, rows, features,
  dtype)`` method), rather than through a key folded with each row's number."""
  return callable(getattr(init, "rows", None))
