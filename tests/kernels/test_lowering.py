"""Every kernel, forward and gradient, lowers for CUDA on this CPU machine with its Triton call.

This is the CI proof that the GPU path builds (see ``embedlib/kernels/lowering.py``).
The kernels are named (``embedlib_gather``, ``embedlib_bag``,
``embedlib_segment_sum``) and the names show in the lowered text, so each test
checks that the right kernel, not just any Triton call, is there.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import axes, kernels, options
from embedlib.kernels.lowering import TRITON_CALL, cuda_lowering_text, gpu_abstract_mesh

S = jax.ShapeDtypeStruct
TABLE = S((1000, 100), jnp.float32)  # a width that is not a power of two
IDS = S((37, 5), jnp.int32)
WEIGHTS = S((37, 5), jnp.float32)


def assert_triton(text, *names):
  assert TRITON_CALL in text
  for name in names:
    assert name in text, f"kernel {name} missing from the CUDA lowering"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_forward_lowers_for_cuda(dtype):
  text = cuda_lowering_text(
      lambda t, i: kernels.gather(t, i, kernel="pallas"), S(TABLE.shape, dtype), IDS
  )
  assert_triton(text, "embedlib_gather")
  assert "embedlib_segment_sum" not in text


def test_gather_grad_lowers_for_cuda():
  grad = jax.grad(lambda t, i: kernels.gather(t, i, kernel="pallas").sum())
  assert_triton(cuda_lowering_text(grad, TABLE, IDS), "embedlib_segment_sum")


@pytest.mark.parametrize("combiner", options.COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
def test_bag_forward_and_grad_lower_for_cuda(combiner, weighted):
  def pooled(t, i, w):
    return kernels.bag(t, i, w if weighted else None, combiner=combiner, kernel="pallas")

  assert_triton(cuda_lowering_text(pooled, TABLE, IDS, WEIGHTS), "embedlib_bag")
  grad = jax.grad(lambda t, i, w: pooled(t, i, w).sum(), argnums=(0, 2))
  assert_triton(cuda_lowering_text(grad, TABLE, IDS, WEIGHTS), "embedlib_segment_sum")


def test_auto_kernel_picks_pallas_when_lowering_for_gpu():
  """Under the abstract GPU mesh, kernel="auto" and interpret=None select the compiled kernel."""
  text = cuda_lowering_text(lambda t, i: kernels.gather(t, i), TABLE, IDS)
  assert_triton(text, "embedlib_gather")


def test_vocab_parallel_shard_map_lowers_with_triton_and_all_reduce():
  mesh = gpu_abstract_mesh((2, 4), (axes.DATA, axes.MODEL))

  def body(local, ids):
    offset = jax.lax.axis_index(axes.MODEL) * local.shape[0]
    rows = kernels.gather(local, ids - offset, kernel="pallas", interpret=False)
    return jax.lax.psum(rows, axes.MODEL)

  def lookup(table, ids):
    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axes.MODEL), P(axes.DATA)), out_specs=P(axes.DATA)
    )(table, ids)

  table = S((1024, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P(axes.MODEL)))
  ids = S((32,), jnp.int32, sharding=NamedSharding(mesh, P(axes.DATA)))
  text = cuda_lowering_text(lookup, table, ids, mesh=mesh)
  assert_triton(text, "embedlib_gather")
  assert "all_reduce" in text
  grad = jax.grad(lambda t, i: lookup(t, i).astype(jnp.float32).sum())
  assert_triton(cuda_lowering_text(grad, table, ids, mesh=mesh), "embedlib_segment_sum")


def test_lowering_context_rejects_concrete_mesh_with_fix():
  from embedlib.kernels.lowering import lowering_context

  with pytest.raises(TypeError, match="gpu_abstract_mesh"):
    lowering_context(jax.make_mesh((8,), (axes.MODEL,)))
