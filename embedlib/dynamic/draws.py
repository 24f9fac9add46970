"""Threefry keys whose hash is unrolled: the stock keys' bits, cheaper on CPU.

A placed row's initial value is the table's ``embedding_init`` drawn with
the init key folded with the row number, and a step draws tens of
thousands of rows. jax lowers its threefry hash for XLA:CPU as a rolled
loop of five iterations, which XLA does not fuse with the values around it;
on a GPU it is unrolled. ``UNROLLED`` is a PRNG implementation that
computes the same hash (threefry-2x32, 20 rounds) unrolled in jnp, and
``fold_in``, ``split`` and ``random_bits`` as jax's partitionable threefry
does, so a key of it gives bit for bit the values a stock threefry key with
the same data gives (``tests/dynamic/test_draws.py``), whatever the
initializer does with it. ``impl_for`` uses it only where that holds (jax's
default PRNG settings).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import random as jax_random

_U32 = jnp.uint32
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def _rotate_left(x, d: int):
  return (x << _U32(d)) | (x >> _U32(32 - d))


def threefry_2x32(k1, k2, x0, x1):
  """Threefry-2x32 of the counter words ``(x0, x1)`` under the key ``(k1, k2)``.

  >>> [int(v) for v in threefry_2x32(_U32(0), _U32(0), _U32(0), _U32(0))]
  [1797259609, 2579123966]
  """
  ks = (k1, k2, k1 ^ k2 ^ _U32(_PARITY))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = x0 ^ _rotate_left(x1, r)
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + _U32(i + 1)
  return x0, x1


def _counters(shape):
  """jax's ``iota_2x32_shape``: the flat index's high and low words."""
  n = math.prod(shape)
  if n > 2**32:
    raise NotImplementedError(f"random bits of {n} values: at most 2**32 per key here")
  return jnp.zeros(shape, _U32), lax.iota(_U32, n).reshape(shape)


def _seed(seed):
  return jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))


def _fold_in(key, data):
  y0, y1 = threefry_2x32(key[0], key[1], _U32(0), jnp.asarray(data).astype(_U32))
  return jnp.stack([y0, y1])


def _split(key, shape):
  b1, b2 = threefry_2x32(key[0], key[1], *_counters(shape))
  return jnp.stack([b1, b2], axis=b1.ndim)


def _random_bits(key, bit_width, shape):
  b1, b2 = threefry_2x32(key[0], key[1], *_counters(shape))
  if bit_width == 64:
    wide = np.dtype("uint64")
    return (lax.convert_element_type(b1, wide) << wide.type(32)) | lax.convert_element_type(b2, wide)
  bits = b1 ^ b2
  return bits if bit_width == 32 else bits.astype(np.dtype(f"uint{bit_width}"))


#: threefry-2x32, partitionable, with the hash unrolled (keys: uint32 ``[2]``).
UNROLLED = jax_random.define_prng_impl(
    key_shape=(2,), seed=_seed, split=_split, random_bits=_random_bits, fold_in=_fold_in,
    name="threefry2x32_unrolled", tag="fry_u")


def impl_for(key_data):
  """``UNROLLED`` for the data of a default key when it gives the same bits, else None.

  That is while jax's default PRNG is threefry-2x32 and partitionable (the
  defaults); under any other setting the stock key is drawn as it is.
  """
  same = (jax.config.jax_default_prng_impl == "threefry2x32"
          and jax.config.jax_threefry_partitionable and tuple(key_data.shape) == (2,))
  return UNROLLED if same else None
