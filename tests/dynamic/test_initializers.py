"""A dynamic table's rows start at the same bits however they are drawn.

``HashedUniform`` (the default) against a plain numpy version of its hash,
its variance against ``default_embed_init``'s; then, for it and for the
normal draw by option, a table's created rows against the rows its steps
draw again after evictions, on one device and on eight.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx.nn.linear import default_embed_init

import embedlib
from embedlib.dynamic import HashedUniform
from embedlib.dynamic import mapping
from tests import covering
from tests.dynamic import helpers


def _mix(x):
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x85EBCA6B)
  x = x ^ (x >> np.uint32(13))
  x = x * np.uint32(0xC2B2AE35)
  return x ^ (x >> np.uint32(16))


def _numpy_rows(key_data, rows, features, scale=1.0):
  """HashedUniform's values from its docstring's recipe, in numpy."""
  k0, k1 = np.asarray(key_data, np.uint32)
  with np.errstate(over="ignore"):
    r = _mix(np.asarray(rows).astype(np.uint32) ^ k0)
    c = _mix(_mix(np.arange(features, dtype=np.uint32) ^ k1) ^ k0)
    bits = _mix(r[:, None] ^ c)
  odd = ((bits >> np.uint32(7)) | np.uint32(1)).astype(np.int64) - 2**24
  return odd.astype(np.float32) * np.float32(np.sqrt(3.0 * scale / features) / 2**24)


@pytest.mark.parametrize("features", [1, 3, 64])
def test_hashed_uniform_equals_numpy_bit_for_bit(features):
  key_data = jax.random.key_data(jax.random.key(11))
  rows = np.array([0, 1, 7, 2**20 + 3, 2**31 - 1], np.int32)
  want = _numpy_rows(key_data, rows, features)
  init = HashedUniform()
  np.testing.assert_array_equal(np.asarray(init.rows(key_data, jnp.asarray(rows), features)),
                                want)
  jitted = jax.jit(mapping.init_rows, static_argnums=(0, 3, 4))
  np.testing.assert_array_equal(
      np.asarray(jitted(init, key_data, jnp.asarray(rows), features, jnp.float32)), want)
  # As a flax initializer, row r of the table is the draw of row r.
  table = init(jax.random.key(11), (8, features))
  np.testing.assert_array_equal(np.asarray(table[7]), want[2])


def test_hashed_uniform_has_the_default_embed_init_variance():
  features, n = 64, 1 << 14
  init = HashedUniform()
  values = np.asarray(init(jax.random.key(0), (n, features)))
  normal = np.asarray(default_embed_init(jax.random.key(0), (n, features)))
  # Uniform on [-a, a], a = sqrt(3 / features): variance 1 / features as the normal's.
  # 2**20 values: the sample variance's relative standard error is about 0.1%.
  assert np.abs(values).max() <= init.bound(features)
  assert abs(values.var() * features - 1) < 0.01 and abs(normal.var() * features - 1) < 0.01
  assert abs(values.mean()) < 4 * np.sqrt(1 / features / values.size)
  # Rows and keys draw apart: no correlation past sampling noise (1 / sqrt(64) per pair).
  assert abs(np.corrcoef(values[0], values[1])[0, 1]) < 0.5
  other = np.asarray(init(jax.random.key(1), (n, features)))
  assert abs(np.corrcoef(values.ravel(), other.ravel())[0, 1]) < 0.01
  half = np.asarray(HashedUniform(scale=0.25)(jax.random.key(0), (4, features)))
  np.testing.assert_allclose(half, np.asarray(values[:4]) / 2, rtol=1e-6)
  assert init(jax.random.key(0), (2, 3), jnp.bfloat16).dtype == jnp.bfloat16


INITS = {"hashed (default)": None, "normal, by option": default_embed_init}


# Every pair of values in CI (4 cases); -m slow: all 8.
@pytest.mark.parametrize("init,features,devices", covering.params(list(INITS), [3, 8], [1, 8]))
def test_rows_placed_again_equal_the_created_rows(init, features, devices):
  """A row's first placement keeps its created value, and a row placed again after
  an eviction is drawn in the step: both are its initial value, bit for bit."""
  kw = {} if INITS[init] is None else {"embedding_init": INITS[init]}
  mesh = None if devices == 1 else helpers.mesh(devices)
  emb = embedlib.DynamicEmbed(128, features, bucket_size=16, mesh=mesh, rngs=nnx.Rngs(0), **kw)
  created = np.asarray(emb.rows.embedding[...])
  emb.rows_of(np.arange(1, 600, dtype=np.int64) * 7919)              # fills every bucket
  emb.rows_of(np.arange(600, 1200, dtype=np.int64) * 7919)           # evicts: drawn again
  again = np.flatnonzero(np.asarray(emb.placed_at[...]) == 2)
  assert emb.stats()["evicted"] > 0 and len(again) > 0
  np.testing.assert_array_equal(np.asarray(emb.rows.embedding[...])[again], created[again])
  reference = helpers.ReferenceTable(128, features, emb.init_key[...],
                                     **({} if INITS[init] is None else {"init": INITS[init]}))
  if INITS[init] is None:   # exact by construction, on any device count
    np.testing.assert_array_equal(created, reference.table)
  else:
    # A normal draw's float transform rounds as each program's shapes have it
    # compiled: the reference's one-device [128, features] draw and a device's
    # [16, features] share may differ in the last bit (measured: 1 ulp).
    np.testing.assert_allclose(created, reference.table, rtol=2.5e-7, atol=0)
