"""A placed row's initial value is ``init(fold_in(threefry key, row))``, bit for bit.

``mapping.init_rows`` draws through ``draws.UNROLLED`` (threefry with its
hash unrolled); each initializer here, drawn that way, must equal the same
initializer drawn with jax's stock threefry key of the same data: 32-bit
and 16-bit draws, an initializer that splits and folds its key, and bits
of odd sizes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx.nn.linear import default_embed_init

from embedlib.dynamic import draws
from embedlib.dynamic import mapping


def _splitting(key, shape, dtype):
  a, b = jax.random.split(jax.random.fold_in(key, 3))
  return (jax.random.uniform(a, shape, dtype) + jax.random.truncated_normal(b, -2, 2, shape, dtype)
          + jax.random.randint(key, shape, 0, 9).astype(dtype))


INITS = {
    "default (normal)": (default_embed_init, jnp.float32),
    "uniform, bfloat16": (nnx.initializers.uniform(0.1), jnp.bfloat16),
    "splits and folds": (_splitting, jnp.float32),
}


@pytest.mark.parametrize("name", list(INITS))
def test_init_rows_equal_stock_threefry(name):
  init, dtype = INITS[name]
  key_data = jax.random.key_data(jax.random.key(7))
  rows = jnp.array([0, 5, 2**20 + 3, 2**31 - 1], jnp.int32)

  @jax.jit
  def both(key_data, rows):
    stock = jax.random.wrap_key_data(key_data)
    want = jax.vmap(lambda r: init(jax.random.fold_in(stock, r), (1, 5), dtype)[0])(rows)
    return mapping.init_rows(init, key_data, rows, 5, dtype), want

  got, want = both(key_data, rows)
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)))
  assert len(np.unique(np.asarray(got.astype(jnp.float32)))) > 10   # not all one value


def test_bits_and_split_equal_stock_threefry():
  data = jnp.array([12345, 678], jnp.uint32)
  stock = jax.random.wrap_key_data(data)
  mine = jax.random.wrap_key_data(data, impl=draws.UNROLLED)
  for shape in [(3,), (2, 7)]:
    np.testing.assert_array_equal(np.asarray(jax.random.bits(mine, shape)),
                                  np.asarray(jax.random.bits(stock, shape)))
  np.testing.assert_array_equal(np.asarray(jax.random.key_data(jax.random.split(mine, 3))),
                                np.asarray(jax.random.key_data(jax.random.split(stock, 3))))


def test_other_prng_settings_draw_the_stock_key():
  """Where the unrolled key would not give the stock key's bits, it is not used."""
  key_data = jax.random.key_data(jax.random.key(1))
  assert draws.impl_for(key_data) is draws.UNROLLED
  with jax.threefry_partitionable(False):
    assert draws.impl_for(key_data) is None
  assert draws.impl_for(jnp.zeros((4,), jnp.uint32)) is None       # an rbg key's data


def test_placing_rows_draws_in_chunks_and_never_copies_the_table():
  """No ``[ids, features]`` block of draws, and the donated table updated in place."""
  n, m, features = 1 << 16, 16_384, 32
  place = jax.jit(lambda k, t, p: mapping._place_rows(default_embed_init, k, t, p, 0),
                  donate_argnums=1)
  memory = place.lower(jax.ShapeDtypeStruct((2,), jnp.uint32),
                       jax.ShapeDtypeStruct((n, features), jnp.float32),
                       jax.ShapeDtypeStruct((m,), jnp.int32)).compile().memory_analysis()
  block = m * features * 4   # what a step of all-new ids would draw at once
  assert memory.alias_size_in_bytes == n * features * 4
  # A chunk of draws and the ids' index vectors (a few [m] int32s), never the block.
  assert memory.temp_size_in_bytes < 2 * mapping.place_chunk(m) * features * 4 + 8 * m * 4
  assert memory.temp_size_in_bytes < block // 4, memory.temp_size_in_bytes
  # Chunked, the rows get the values one draw of them all gives.
  key = jax.random.key_data(jax.random.key(3))
  put = jnp.asarray(np.r_[np.arange(9_000) * 7 % n, np.full(m - 9_000, n)], jnp.int32)
  got = np.asarray(place(key, jnp.zeros((n, features)), put))
  draw = jax.jit(lambda k, r: mapping.init_rows(default_embed_init, k, r, features, jnp.float32))
  want = np.asarray(draw(key, put[:9_000]))   # jitted as the step is: eager rounds otherwise
  np.testing.assert_array_equal(got[np.asarray(put[:9_000])], want)
  untouched = np.setdiff1d(np.arange(n), np.asarray(put[:9_000]))
  assert not got[untouched].any()
