"""Interpret-mode Pallas pooled bags against the reference, the combiners' semantics, ragged input."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embedlib import kernels, options
from embedlib.kernels.bag_pallas import bag_pallas
from tests import covering

# f32: the kernel sums slots in order and multiplies by 1/denominator; the
# reference uses einsum with per-slot coefficients. Both accumulate in f32, so
# they agree to a few ulps of the result.
F32_TOL = dict(rtol=2e-6, atol=2e-6)
# bf16 output: the same f32 sums rounded once to bf16 (8 mantissa bits); an
# order difference can flip that rounding by one ulp = 2**-8 relative.
BF16_TOL = dict(rtol=2**-7, atol=2**-7)


def make_bags(batch, bag, num_embeddings, seed=0):
  """Ids with -1 padding at the tail, some invalid ids, duplicates, and an empty last bag."""
  key_ids, key_len, key_w = jax.random.split(jax.random.PRNGKey(seed), 3)
  ids = jax.random.randint(key_ids, (batch, bag), -2, num_embeddings + 2)
  lengths = jax.random.randint(key_len, (batch,), 0, bag + 1).at[-1].set(0)
  ids = jnp.where(jnp.arange(bag)[None, :] < lengths[:, None], ids, -1)
  weights = jax.random.uniform(key_w, (batch, bag), minval=0.1, maxval=2.0)
  return ids, weights


def make_table(num_embeddings, features, dtype=jnp.float32):
  table = jax.random.normal(jax.random.PRNGKey(3), (num_embeddings, features))
  return table.astype(dtype)


# Every pair of values of the four axes in CI (12 cases); -m slow: all 48.
@pytest.mark.parametrize(
    "combiner,weighted,features,num_embeddings",
    covering.params(options.COMBINERS, [False, True], [1, 3, 100, 128], [1, 7]),
)
def test_pallas_bag_equals_reference_f32(combiner, weighted, features, num_embeddings):
  table = make_table(num_embeddings, features)
  ids, weights = make_bags(5, 6, num_embeddings)
  weights = weights if weighted else None
  got = bag_pallas(table, ids, weights, combiner=combiner, interpret=True)
  want = kernels.bag_reference(table, ids, weights, combiner=combiner)
  assert got.shape == (5, features) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, **F32_TOL)
  np.testing.assert_array_equal(got[-1], 0.0)  # the empty bag


@pytest.mark.parametrize("combiner,weighted", list(itertools.product(options.COMBINERS, [False, True])))
def test_pallas_bag_equals_reference_bf16(combiner, weighted):
  table = make_table(7, 100, jnp.bfloat16)
  ids, weights = make_bags(9, 4, 7)
  weights = weights if weighted else None
  got = bag_pallas(table, ids, weights, combiner=combiner, interpret=True)
  want = kernels.bag_reference(table, ids, weights, combiner=combiner)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **BF16_TOL)


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_combiner_semantics_by_hand(kernel):
  """TensorFlow / keras-rs semantics, written out for one bag: valid ids only, padding ignored."""
  table = jnp.array([[1.0, 2.0], [3.0, 5.0], [7.0, 11.0]])
  ids = jnp.array([[0, 2, -1, 9], [-1, -1, -1, -1]])
  weights = jnp.array([[2.0, 3.0, 100.0, 100.0], [1.0, 1.0, 1.0, 1.0]])
  s = 2 * table[0] + 3 * table[2]  # [23, 37]
  expected = {"sum": s, "mean": s / 5.0, "sqrtn": s / np.sqrt(13.0)}
  for combiner, want in expected.items():
    got = kernels.bag(table, ids, weights, combiner=combiner, kernel=kernel)
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
    np.testing.assert_array_equal(got[1], 0.0)
  unweighted = kernels.bag(table, ids, combiner="sqrtn", kernel=kernel)
  np.testing.assert_allclose(unweighted[0], (table[0] + table[2]) / np.sqrt(2.0), rtol=1e-6)


@pytest.mark.parametrize("kernel", ["xla", "pallas", "auto"])
def test_bag_dispatch_under_jit(kernel):
  table = make_table(7, 3)
  ids, weights = make_bags(4, 5, 7)
  f = jax.jit(lambda t, i, w: kernels.bag(t, i, w, combiner="mean", kernel=kernel))
  np.testing.assert_allclose(
      f(table, ids, weights), kernels.bag_reference(table, ids, weights, combiner="mean"), **F32_TOL
  )


def test_bag_errors_name_the_fix():
  table = make_table(7, 3)
  with pytest.raises(ValueError, match="ragged_to_padded"):
    kernels.bag(table, jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match="'sum', 'mean', 'sqrtn'"):
    kernels.bag(table, jnp.zeros((4, 2), jnp.int32), combiner="max")
  with pytest.raises(ValueError, match="weights shape"):
    kernels.bag(table, jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 3)))


def test_ragged_to_padded_matches_per_bag_sums():
  values = jnp.array([4, 1, 1, 6, 0, 2])
  lengths = jnp.array([3, 0, 2, 1])
  weights = jnp.arange(1.0, 7.0)
  ids, w = kernels.ragged_to_padded(values, lengths, 3, weights=weights)
  assert ids.tolist() == [[4, 1, 1], [-1, -1, -1], [6, 0, -1], [2, -1, -1]]
  assert w.tolist() == [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [4.0, 5.0, 0.0], [6.0, 0.0, 0.0]]
  table = make_table(7, 3)
  pooled = kernels.bag(table, ids, w, kernel="pallas")
  np.testing.assert_allclose(pooled[0], table[4] + 2 * table[1] + 3 * table[1], rtol=1e-6)
  np.testing.assert_allclose(pooled[2], 4 * table[6] + 5 * table[0], rtol=1e-6)


def test_ragged_to_padded_refuses_to_drop_ids_eagerly():
  with pytest.raises(ValueError, match="max_bag>=3"):
    kernels.ragged_to_padded(jnp.array([1, 2, 3]), jnp.array([3]), 2)


def test_ragged_to_padded_under_jit_truncates_to_capacity():
  f = jax.jit(lambda v, n: kernels.ragged_to_padded(v, n, 2))
  assert f(jnp.array([1, 2, 3, 4]), jnp.array([3, 1])).tolist() == [[1, 2], [4, -1]]
