"""The C++ pooled bag (``kernels/cpu/bag.cc`` through `bag_cpu`) against the XLA segment sum.

Its terms are `xla.bag_segment_sum`'s rounded products summed slot by slot
from zero, so its values are the jitted segment sum's bit for bit (both
jitted: an op-by-op one rounds the combiner's factors differently). Gradients are
`bag_xla`'s backward, compared to it within float32 rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embedlib import kernels, options
from embedlib.kernels import bag_cpu as bag_cpu_lib
from embedlib.kernels import bag_xla as bag_xla_lib
from embedlib.kernels import xla
from tests import covering
from tests.cpu_kernels import require_cpu_kernels
from tests.kernels.test_bag import make_bags, make_table

F32_TOL = dict(rtol=1e-6, atol=1e-6)


def _reference(table, ids, weights, combiner):
  # Bit for bit: the segment sum adds each bag's rounded products slot by slot
  # from zero, as the kernel does; kernels.bag_reference, the specification,
  # sums them in jnp.sum's order (the tolerance tests compare with it).
  return jax.jit(lambda t: xla.bag_segment_sum(t, ids, weights, combiner=combiner))(table)


# Every pair of values in CI; -m slow: the whole product. Widths 16 to 128
# take the kernel's fixed-width loops, 20 and 3 its general one; 50 rows stay
# in the cache, 70,000 are fetched ahead.
@pytest.mark.parametrize(
    "combiner,weighted,features,bag,num_embeddings",
    covering.params(options.COMBINERS, [False, True], [3, 16, 20, 32, 64, 128], [1, 2, 17],
                    [50, 70_000]),
)
def test_forward_equals_reference_bit_for_bit(combiner, weighted, features, bag, num_embeddings):
  require_cpu_kernels()
  table = make_table(num_embeddings, features)
  ids, weights = make_bags(40, bag, num_embeddings)
  weights = weights if weighted else None
  got = jax.jit(lambda t: bag_cpu_lib.bag_cpu(t, ids, weights, combiner=combiner))(table)
  assert got.dtype == jnp.float32 and got.shape == (40, features)
  np.testing.assert_array_equal(got, _reference(table, ids, weights, combiner))
  np.testing.assert_array_equal(got[-1], 0.0)  # the empty bag


@pytest.mark.parametrize("combiner", options.COMBINERS)
def test_many_bags_over_threads_equal_reference(combiner):
  """Enough ids (40,000) for the pool to split the bags; signed weights, ids past the table."""
  require_cpu_kernels()
  rng = np.random.default_rng(1)
  table = jnp.asarray(rng.standard_normal((5_000, 64)), jnp.float32)
  ids = jnp.asarray(rng.integers(-3, 5_003, (2_500, 16)), jnp.int32)
  weights = jnp.asarray(rng.standard_normal((2_500, 16)), jnp.float32)
  for w in (None, weights):
    got = jax.jit(lambda t, w=w: bag_cpu_lib.bag_cpu(t, ids, w, combiner=combiner))(table)
    np.testing.assert_array_equal(got, _reference(table, ids, w, combiner))


@pytest.mark.parametrize("combiner,weighted", covering.params(options.COMBINERS, [False, True]))
def test_gradients_equal_the_xla_bags(combiner, weighted):
  """Table gradient (repeats summed, padding dropped) and weights gradient."""
  require_cpu_kernels()
  table = make_table(30, 16)
  ids, weights = make_bags(12, 5, 30)
  cot = jax.random.normal(jax.random.PRNGKey(4), (12, 16))

  def loss(fn, t, w):
    return jnp.sum(fn(t, ids, w if weighted else None, combiner=combiner) * cot)

  grad = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
  got, want = grad(bag_cpu_lib.bag_cpu, table, weights), grad(bag_xla_lib.bag_xla, table, weights)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, **F32_TOL)
  assert np.any(np.asarray(got[0]) != 0)


def test_the_default_kernel_on_cpu_takes_it_for_float32_only():
  require_cpu_kernels()
  ids, _ = make_bags(4, 3, 7)
  lowered = lambda t: jax.jit(lambda t: kernels.bag(t, ids, combiner="mean")).lower(t).as_text()
  assert "embedlib_bag" in lowered(make_table(7, 8))
  assert "embedlib_bag" not in lowered(make_table(7, 8, jnp.bfloat16))
