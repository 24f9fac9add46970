"""The slot-by-slot XLA bag (``kernel="xla"``) against ``bag_reference``: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from embedlib import _compat, kernels, options
from embedlib.kernels import bag_xla as bag_xla_lib  # the module
from embedlib.kernels import xla
from tests import covering
from tests.kernels.test_bag import make_bags, make_table

F32_TOL = dict(rtol=1e-6, atol=1e-6)
BF16_TOL = dict(rtol=2**-5, atol=2**-5)


# Every pair of values of the four axes in CI (9 cases); -m slow: all 54.
@pytest.mark.parametrize(
    "combiner,weighted,features,num_embeddings",
    covering.params(options.COMBINERS, [False, True], [1, 3, 128], [1, 7, 50]),
)
def test_forward_equals_reference(combiner, weighted, features, num_embeddings):
  """Same f32 terms, added in the same (slot) order: equal up to XLA's fused multiply-adds."""
  table = make_table(num_embeddings, features)
  ids, weights = make_bags(6, 5, num_embeddings)
  weights = weights if weighted else None
  got = jax.jit(lambda t: kernels.bag(t, ids, weights, combiner=combiner, kernel="xla"))(table)
  want = jax.jit(lambda t: kernels.bag_reference(t, ids, weights, combiner=combiner))(table)
  assert got.dtype == jnp.float32 and got.shape == (6, features)
  np.testing.assert_allclose(got, want, **F32_TOL)
  np.testing.assert_array_equal(got[-1], 0.0)  # the empty bag


@pytest.mark.parametrize(
    "combiner,weighted,dtype",
    covering.params(options.COMBINERS, [False, True], [jnp.float32, jnp.bfloat16]),  # slow: all 12
)
def test_grads_equal_reference_grads(combiner, weighted, dtype):
  """Table gradient (duplicates summed, padding and invalid ids dropped) and weights gradient."""
  table = make_table(7, 9, dtype)
  ids = jax.random.randint(jax.random.PRNGKey(5), (6, 4), -2, 5).at[-1].set(-1)
  weights = jax.random.uniform(jax.random.PRNGKey(4), ids.shape, minval=0.5, maxval=2.0)
  cot = jax.random.normal(jax.random.PRNGKey(6), (6, 9))

  def loss(fn, t, w):
    out = fn(t, ids, w if weighted else None, combiner=combiner)
    return jnp.sum(out.astype(jnp.float32) * cot)

  grad = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
  got_t, got_w = grad(bag_xla_lib.bag_xla, table, weights)
  want_t, want_w = grad(kernels.bag_reference, table, weights)
  assert got_t.dtype == dtype
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  np.testing.assert_allclose(np.asarray(got_t, np.float32), np.asarray(want_t, np.float32), **tol)
  np.testing.assert_allclose(got_w, want_w, **tol)
  np.testing.assert_array_equal(got_t[5:], 0.0)  # rows no valid id reads
  if weighted:
    assert np.abs(np.asarray(got_w)).max() > 0


def test_wide_bags_take_the_segment_sum():
  bag = bag_xla_lib.MAX_UNROLLED_SLOTS + 1
  table = make_table(11, 3)
  ids, weights = make_bags(3, bag, 11)
  got = kernels.bag(table, ids, weights, combiner="sqrtn", kernel="xla")
  want = xla.bag_segment_sum(table, ids, weights, combiner="sqrtn")
  np.testing.assert_array_equal(got, want)  # the segment sum itself
  np.testing.assert_allclose(
      got, kernels.bag_reference(table, ids, weights, combiner="sqrtn"), **F32_TOL)
  empty = kernels.bag(table, jnp.zeros((3, 0), jnp.int32), kernel="xla")
  np.testing.assert_array_equal(empty, jnp.zeros((3, 3)))


def test_grad_inside_shard_map_sums_over_data_shards():
  """A table replicated over the data axis, ids split over it: the backward's psum."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  table = make_table(7, 5)
  ids, weights = make_bags(8, 3, 7)

  def local(t, i, w):
    return kernels.bag(t, i, w, combiner="mean", kernel="xla")

  def loss_sharded(t):
    f = _compat.shard_map(
        local, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P("data")
    )
    return jnp.sum(f(t, ids, weights) ** 2)

  loss_ref = lambda t: jnp.sum(kernels.bag_reference(t, ids, weights, combiner="mean") ** 2)
  np.testing.assert_allclose(
      jax.jit(jax.grad(loss_sharded))(table), jax.grad(loss_ref)(table), **F32_TOL
  )


@pytest.mark.parametrize("combiner", options.COMBINERS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_single_hot_bag_on_cpu_is_the_xla_bags_bit_for_bit(combiner, dtype):
  """``kernel="cpu"`` bags of one id a row (C++ bag or gather): `bag_xla`'s values and gradients."""
  from embedlib.kernels import bag_cpu, cpu_library  # pylint: disable=import-outside-toplevel

  if not cpu_library.available():
    pytest.skip("no CPU kernels' library here")
  table = make_table(7, 9, dtype)
  ids = jnp.array([[0], [6], [-1], [7], [3], [3]])     # padding, one past the table, a repeat
  weights = jnp.array([[0.5], [2.0], [1.0], [3.0], [-1.5], [1.0]])
  cot = jax.random.normal(jax.random.PRNGKey(6), (6, 9))

  def loss(fn, t, w):
    return jnp.sum(fn(t, ids, w, combiner=combiner).astype(jnp.float32) * cot)

  for w in (None, weights):
    got = jax.jit(lambda t: bag_cpu.bag_cpu(t, ids, w, combiner=combiner))(table)
    want = jax.jit(lambda t: bag_xla_lib.bag_xla(t, ids, w, combiner=combiner))(table)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  grad = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
  for got, want in zip(grad(bag_cpu.bag_cpu, table, weights),
                       grad(bag_xla_lib.bag_xla, table, weights)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **F32_TOL)
  # The default kernel on CPU takes the C++ bag for such a float32 bag, the
  # C++ gather for other dtypes.
  text = jax.jit(lambda t: kernels.bag(t, ids, combiner=combiner)).lower(table).as_text()
  assert ("embedlib_bag" if dtype == jnp.float32 else "embedlib_gather") in text
