"""Interpret-mode Pallas gather and the CPU C++ gather against the reference, and the dispatcher."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from embedlib import axes, kernels
from embedlib.kernels import cpu_library, lowering, mosaic
from embedlib.kernels.gather_cpu import gather_cpu
from embedlib.kernels.gather_pallas import gather_pallas, next_pow2

from .. import covering
from ..cpu_kernels import require_cpu_kernels

FEATURES = (1, 3, 100, 128)
VOCABS = (1, 7)
DTYPES = (jnp.float32, jnp.bfloat16)


def make_table(num_embeddings, features, dtype, seed=0):
  table = jax.random.normal(jax.random.PRNGKey(seed), (num_embeddings, features))
  return table.astype(dtype)


def make_ids(shape, num_embeddings, seed=1):
  """Ids covering every row, duplicates, negatives and ids >= num_embeddings."""
  return jax.random.randint(jax.random.PRNGKey(seed), shape, -3, num_embeddings + 3)


# Every width with every dtype (the bytes a row copies) and every table
# size with both, in CI; -m slow runs the whole product (tests/covering.py).
@pytest.mark.parametrize("features,num_embeddings,dtype", covering.params(FEATURES, VOCABS, DTYPES))
def test_pallas_gather_equals_reference_exactly(features, num_embeddings, dtype):
  table = make_table(num_embeddings, features, dtype)
  ids = make_ids((3, 11), num_embeddings)
  got = gather_pallas(table, ids, interpret=True)
  want = kernels.gather_reference(table, ids)
  assert got.shape == (3, 11, features) and got.dtype == table.dtype
  # A copy is exact in every dtype: no tolerance.
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_reference_follows_invalid_id_rule():
  table = make_table(5, 3, jnp.float32)
  ids = jnp.array([0, 4, -1, 5, -100, 99, 2])
  got = np.asarray(kernels.gather_reference(table, ids))
  np.testing.assert_array_equal(got[[0, 1, 6]], np.asarray(table)[[0, 4, 2]])
  np.testing.assert_array_equal(got[[2, 3, 4, 5]], 0.0)


@pytest.mark.parametrize("kernel", ["xla", "pallas", "cpu", "auto"])
def test_gather_dispatch_under_jit(kernel):
  table = make_table(7, 100, jnp.float32)
  ids = make_ids((37,), 7)
  got = jax.jit(lambda t, i: kernels.gather(t, i, kernel=kernel))(table, ids)
  np.testing.assert_array_equal(got, kernels.gather_reference(table, ids))


@pytest.mark.parametrize("kernel", ["pallas", "cpu"])
def test_gather_empty_ids_and_scalar_id(kernel):
  table = make_table(7, 3, jnp.float32)
  assert kernels.gather(table, jnp.zeros((0, 4), jnp.int32), kernel=kernel).shape == (0, 4, 3)
  np.testing.assert_array_equal(kernels.gather(table, jnp.array(6), kernel=kernel), table[6])


@pytest.mark.parametrize("kernel", ["xla", "pallas", "cpu"])
def test_gather_and_grad_inside_shard_map_vocab_parallel(kernel):
  """The vocab strategy's body on a 2 x 4 mesh: ids split over data, table rows over model.

  Local lookup of shifted ids, then psum over model; the table gradient must
  also be summed over data (the table is replicated there).
  """
  mesh = jax.make_mesh((2, 4), (axes.DATA, axes.MODEL), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  table = make_table(4 * 3, 5, jnp.float32)
  ids = make_ids((10,), 4 * 3)
  cot = jax.random.normal(jax.random.PRNGKey(2), (10, 5))

  def body(local, ids):
    offset = jax.lax.axis_index(axes.MODEL) * local.shape[0]
    return jax.lax.psum(kernels.gather(local, ids - offset, kernel=kernel), axes.MODEL)

  f = jax.shard_map(
      body,
      in_specs=(P(axes.MODEL), P(axes.DATA)),
      out_specs=P(axes.DATA),
      check_vma=kernels.shard_map_check_vma(kernel),
  )
  loss = lambda t, i: jnp.sum(f(t, i) * cot)
  ref_loss = lambda t: jnp.sum(kernels.gather_reference(t, ids) * cot)
  with jax.set_mesh(mesh):
    sharded = jax.sharding.reshard(table, P(axes.MODEL))
    ids_sharded = jax.sharding.reshard(ids, P(axes.DATA))
    got = jax.jit(f)(sharded, ids_sharded)
    grad = jax.jit(jax.grad(loss))(sharded, ids_sharded)
  np.testing.assert_array_equal(got, kernels.gather_reference(table, ids))
  np.testing.assert_allclose(grad, jax.grad(ref_loss)(table), rtol=1e-6, atol=1e-6)


def test_plan_gives_each_platform_its_kernel(monkeypatch):
  require_cpu_kernels()
  backend = kernels.pallas_backend()   # mosaic from jax 0.11, triton on 0.10
  assert backend == ("mosaic" if mosaic.has_interpreter() else "triton")
  assert kernels.plan("auto") == {"cpu": "cpu", "gpu": backend, "default": "xla"}
  assert kernels.plan("triton") == {"cpu": "triton-interpret", "gpu": "triton", "default": "xla"}
  # The compiled Mosaic kernels beside their interpreter carry its ordered effect.
  beside = "mosaic-ordered" if backend == "mosaic" else backend
  assert kernels.plan("pallas") == {"cpu": backend + "-interpret", "gpu": beside,
                                    "default": "xla"}
  assert set(kernels.plan("pallas", interpret=True).values()) == {backend + "-interpret"}
  assert set(kernels.plan("pallas", interpret=False).values()) == {backend}
  # jax 0.10 has no Mosaic GPU interpreter: its CPU runs XLA's ops.
  assert kernels.plan("mosaic")["cpu"] == ("mosaic-interpret" if backend == "mosaic" else "xla")
  assert kernels.plan("cpu") == {"cpu": "cpu", "gpu": "xla", "default": "xla"}
  assert kernels.resolve_kernel("auto") == "cpu"
  assert kernels.resolve_kernel("auto", "cuda") == backend
  with pytest.raises(ValueError, match=r"kernel='mosaik'.*use one of \('auto', 'xla', 'pallas'"):
    kernels.resolve_kernel("mosaik")
  monkeypatch.setattr(cpu_library, "library", lambda: None)   # no compiler here
  assert kernels.resolve_kernel("auto") == "xla"


def test_cpu_kernel_lowered_for_cuda_is_xla_there():
  """kernel='cpu' names the CPU's C++ gather; a CUDA lowering holds XLA's gather instead."""
  S = jax.ShapeDtypeStruct
  fn = lambda t, i: kernels.gather(t, i, kernel="cpu")
  text = lowering.cuda_lowering_text(fn, S((50, 8), jnp.float32), S((7,), jnp.int32))
  assert "embedlib_gather" not in text and "stablehlo.gather" in text


# Every row width the C++ gather copies with a fixed size (16 to 512 bytes)
# and others (any size).
CPU_FEATURES = sorted(set(FEATURES) | {4, 8, 16, 32, 64})


@pytest.mark.parametrize("features,num_embeddings,dtype",
                         covering.params(CPU_FEATURES, VOCABS, DTYPES))
def test_cpu_gather_equals_reference_exactly(features, num_embeddings, dtype):
  require_cpu_kernels()
  table = make_table(num_embeddings, features, dtype)
  ids = make_ids((3, 11), num_embeddings)
  got = gather_cpu(table, ids)
  assert got.shape == (3, 11, features) and got.dtype == table.dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(kernels.gather_reference(table, ids), np.float32))


def test_cpu_gather_many_rows_on_threads_and_narrow_ids():
  # 10,000 ids: split over threads (one per 2,048 rows, up to the CPUs);
  # int16 ids are widened, invalid ones still read zeros.
  require_cpu_kernels()
  table = make_table(3000, 24, jnp.float32)
  ids = make_ids((10_000,), 3000)
  np.testing.assert_array_equal(gather_cpu(table, ids), kernels.gather_reference(table, ids))
  small = jnp.array([0, 2999, -1, 3000], jnp.int16)
  np.testing.assert_array_equal(gather_cpu(table, small), kernels.gather_reference(table, small))


def test_cpu_gather_gradient_is_the_references():
  require_cpu_kernels()
  table = make_table(7, 5, jnp.float32)
  ids = make_ids((4, 9), 7)
  cot = jax.random.normal(jax.random.PRNGKey(3), (4, 9, 5))
  grad = jax.jit(jax.grad(lambda t: jnp.sum(gather_cpu(t, ids) * cot)))(table)
  want = jax.grad(lambda t: jnp.sum(kernels.gather_reference(t, ids) * cot))(table)
  np.testing.assert_array_equal(grad, want)


def test_gather_rejects_float_ids_with_fix():
  with pytest.raises(ValueError, match=r"astype\(jnp.int32\)"):
    kernels.gather(make_table(3, 2, jnp.float32), jnp.array([0.0, 1.0]))


@pytest.mark.parametrize("n,want", [(1, 1), (3, 4), (64, 64), (100, 128), (129, 256)])
def test_next_pow2(n, want):
  assert next_pow2(n) == want
