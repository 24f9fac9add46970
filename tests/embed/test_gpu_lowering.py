"""ShardedEmbed's GPU path builds: Pallas kernel (Mosaic GPU, or Triton on jax 0.10) + collectives.

Tables are 256 wide so that every local column slice is whole 16-byte rows
(Mosaic GPU copies rows by TMA; narrower slices run XLA's ops, see
``embedlib/kernels/mosaic.py``). Lowered for CUDA on this CPU-only machine through an abstract H200 mesh
(``embedlib.kernels.lowering``), forward and gradient, for every strategy.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import embedlib
from embedlib import kernels
from embedlib.kernels import lowering

# The compiled kernel kernel="auto" puts in a CUDA lowering on this jax where
# `gpu_choice` lists no shape (`auto_runs_pallas_on_gpu`).
GPU_CALL = {"mosaic": lowering.MOSAIC_GPU_CALL, "triton": lowering.TRITON_CALL}[
    kernels.pallas_backend()]

# (mesh shape, names, strategy, table_axes, data_axes, collectives in fwd / grad)
CASES = {
    "vocab-tp": ((2, 4), ("data", "model"), "vocab", None, None, ["all_reduce"]),
    "hidden-tp": ((2, 4), ("data", "model"), "hidden", None, None, ["all_gather"]),
    "vocab-tokens": ((8,), ("batch",), "vocab", None, None, ["all_gather", "reduce_scatter"]),
    "hidden-tokens": ((8,), ("batch",), "hidden", None, None, ["all_gather", "all_to_all"]),
    "hidden-replica": ((2, 4), ("replica", "batch"), "hidden", ("batch",), None,
                       ["all_gather", "all_to_all"]),
    "replicated": ((8,), ("batch",), "replicated", None, None, []),
    # The route, and in the same program the vocab path of an overflowing step.
    "routed-tokens": ((8,), ("batch",), "routed", None, None,
                      ["all_to_all", "all_gather", "reduce_scatter"]),
    "routed-tp": ((2, 4), ("data", "model"), "routed", None, None,
                  ["all_to_all", "all_gather", "all_reduce"]),
    # Rows over tensor, columns over fsdp (the data axis): FSDP x tensor parallel.
    "grid-fsdp-tp": ((2, 4), ("fsdp", "tensor"), "grid", ("tensor",), None,
                     ["all_gather", "all_reduce", "all_to_all"]),
}


@pytest.mark.usefixtures("auto_runs_pallas_on_gpu")
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_embed_lowers_for_cuda_with_pallas_and_collectives(case):
  shape, names, strategy, table_axes, data_axes, collectives = CASES[case]
  mesh = lowering.gpu_abstract_mesh(shape, names)
  with lowering.lowering_context(mesh):
    emb = nnx.eval_shape(lambda: embedlib.ShardedEmbed(
        1000, 256, mesh=mesh, sharding=strategy, table_axes=table_axes,
        data_axes=data_axes, kernel="auto", rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(emb)
  abstract_state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  ids = jax.ShapeDtypeStruct((64, 4), jnp.int32,
                             sharding=NamedSharding(mesh, P(emb.plan.data_axes or None)))

  def forward(s, i):
    return nnx.merge(graphdef, s)(i)

  def grad(s, i):
    return jax.grad(lambda s: jnp.sum(forward(s, i) ** 2))(s)

  for fn in (forward, grad):
    text = lowering.cuda_lowering_text(fn, abstract_state, ids, mesh=mesh)
    assert GPU_CALL in text, (case, fn.__name__)
    assert "embedlib_gather" in text or "embedlib_segment_sum" in text
    for collective in collectives:
      assert collective in text, (case, fn.__name__, collective)
