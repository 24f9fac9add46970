"""Gradients of the Pallas lookups (custom_vjp + deterministic segment sum) against jax.grad of the references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embedlib import kernels, options
from embedlib.kernels.backward import segment_sum_rows, segments
from tests import covering

# bf16 tables: the reference scatter-adds duplicates in bf16, the kernel sums in
# f32 and rounds once, so they differ by up to a few bf16 ulps (2**-8 relative).
BF16_TOL = dict(rtol=2**-5, atol=2**-5)
F32_TOL = dict(rtol=1e-6, atol=1e-6)


def table_and_cotangent(num_embeddings, features, out_shape, dtype):
  table = jax.random.normal(jax.random.PRNGKey(0), (num_embeddings, features)).astype(dtype)
  cot = jax.random.normal(jax.random.PRNGKey(1), out_shape + (features,)).astype(dtype)
  return table, cot


def duplicate_ids(shape, num_embeddings):
  """Few distinct rows, so most ids repeat; plus negatives and ids past the end."""
  return jax.random.randint(jax.random.PRNGKey(2), shape, -2, min(num_embeddings, 3) + 2)


@pytest.mark.parametrize(
    "features,num_embeddings,dtype",
    covering.params([1, 3, 100], [1, 7], [jnp.float32, jnp.bfloat16]),  # -m slow: all 12
)
def test_gather_grad_equals_reference_grad(features, num_embeddings, dtype):
  ids = duplicate_ids((4, 6), num_embeddings)
  table, cot = table_and_cotangent(num_embeddings, features, ids.shape, dtype)
  grad = jax.jit(jax.grad(lambda t: jnp.sum(kernels.gather(t, ids, kernel="pallas") * cot)))(
      table)
  want = jax.jit(jax.grad(lambda t: jnp.sum(kernels.gather_reference(t, ids) * cot)))(table)
  assert grad.dtype == table.dtype
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(want, np.float32), **tol)
  if num_embeddings == 7:
    np.testing.assert_array_equal(grad[5:], 0.0)  # rows no id touches


@pytest.mark.parametrize(
    "combiner,weighted,features",
    covering.params(options.COMBINERS, [False, True], [3, 100]),  # -m slow: all 12
)
def test_bag_grads_equal_reference_grads(combiner, weighted, features):
  ids = duplicate_ids((5, 4), 7).at[-1].set(-1)  # last bag empty
  table, cot = table_and_cotangent(7, features, (5,), jnp.float32)
  weights = jax.random.uniform(jax.random.PRNGKey(4), ids.shape, minval=0.5, maxval=2.0)

  def loss(fn, t, w):
    return jnp.sum(fn(t, ids, w if weighted else None, combiner=combiner) * cot)

  pallas = lambda t, i, w, combiner: kernels.bag(t, i, w, combiner=combiner, kernel="pallas")
  got_t, got_w = jax.jit(jax.grad(lambda t, w: loss(pallas, t, w), argnums=(0, 1)))(
      table, weights)
  want_t, want_w = jax.jit(jax.grad(lambda t, w: loss(kernels.bag_reference, t, w),
                                    argnums=(0, 1)))(table, weights)
  np.testing.assert_allclose(got_t, want_t, **F32_TOL)
  np.testing.assert_allclose(got_w, want_w, **F32_TOL)
  if weighted:
    assert np.abs(np.asarray(got_w)).max() > 0  # the weights really get a gradient


def test_eager_grads_equal_the_jit_ones():
  """The cases above run under jit (one program each, not one per primitive); once eagerly."""
  ids = duplicate_ids((5, 4), 7)
  table, cot = table_and_cotangent(7, 3, (5,), jnp.float32)
  weights = jax.random.uniform(jax.random.PRNGKey(4), ids.shape, minval=0.5, maxval=2.0)
  losses = [
      lambda t, w: jnp.sum(kernels.gather(t, ids, kernel="pallas") * cot[:, None]),
      lambda t, w: jnp.sum(kernels.bag(t, ids, w, combiner="mean", kernel="pallas") * cot),
  ]
  for loss in losses:
    eager = jax.grad(loss, argnums=(0, 1))(table, weights)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1)))(table, weights)
    for a, b in zip(eager, jitted):
      np.testing.assert_allclose(a, b, **F32_TOL)


def test_bag_grad_bf16_under_jit():
  ids = duplicate_ids((6, 3), 7)
  table, cot = table_and_cotangent(7, 100, (6,), jnp.bfloat16)
  f = lambda fn: jax.jit(jax.grad(lambda t: jnp.sum(fn(t).astype(jnp.float32) * cot)))
  got = f(lambda t: kernels.bag(t, ids, combiner="sqrtn", kernel="pallas"))(table)
  want = f(lambda t: kernels.bag_reference(t, ids, combiner="sqrtn"))(table)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **BF16_TOL)


def test_segments_plan_matches_numpy_unique():
  ids = jnp.array([5, -1, 2, 5, 9, 2, 2, 0])
  order, starts, ends, rows, count = segments(ids, 6)
  uniq, counts = np.unique(np.array([5, 2, 5, 2, 2, 0]), return_counts=True)
  assert int(count) == len(uniq)
  assert rows[: len(uniq)].tolist() == uniq.tolist()
  assert (ends - starts)[: len(uniq)].tolist() == counts.tolist()
  assert np.all(np.asarray(ends - starts)[len(uniq):] == 0)
  # Stable: duplicates keep their original order, which fixes the summation order.
  assert order[starts[1]:ends[1]].tolist() == [2, 5, 6]


def test_segment_sum_rows_sums_in_original_order_in_f32():
  # Left to right in f32, 1 + 2**-24 + 2**-24 stays 1 (each small term is half
  # an ulp and rounds to even); any other order gives 1 + 2**-23.
  g = jnp.array([[1.0], [2.0**-24], [2.0**-24], [3.0]])
  ids = jnp.array([4, 4, 4, 1])
  got = segment_sum_rows(g, jnp.arange(4), ids, 5, interpret=True)
  assert got[:, 0].tolist() == [0.0, 3.0, 0.0, 0.0, 1.0]


def test_segment_sum_rows_is_reproducible():
  g = jax.random.normal(jax.random.PRNGKey(5), (64, 3))
  ids = jax.random.randint(jax.random.PRNGKey(6), (64,), 0, 4)
  a = segment_sum_rows(g, jnp.arange(64), ids, 4, interpret=True)
  b = segment_sum_rows(g, jnp.arange(64), ids, 4, interpret=True)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(a, jax.ops.segment_sum(g, ids, 4), rtol=1e-5, atol=1e-5)
