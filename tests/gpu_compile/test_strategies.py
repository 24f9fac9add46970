"""Each strategy's lookup and gradient compiles for 8 H100s, collectives asynchronous.

The cases of ``tests/embed/test_gpu_lowering.py`` (replicated, vocab,
hidden, routed, the 2-D grid; tensor-parallel and token-sharded meshes),
each compiled as one program that returns the lookup and the table's
gradient. Lowering showed the collectives' names; the compiled program
shows whether XLA's scheduler runs them as start / done pairs.

CI compiles each strategy and each kind of mesh at least once
(`CI_CASES`), whose collectives between them hold every other case's:
routed-tokens holds the vocab path on a token-sharded mesh (an overflowing
step's), hidden-replica the hidden strategy's all-to-all. ``-m slow`` adds
vocab-tokens, hidden-tp, hidden-tokens and routed-tp.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import embedlib
from embedlib.kernels import deviceless
from tests.embed.test_gpu_lowering import CASES
from tests.gpu_compile import compiled

# StableHLO names (the lowering tests') -> optimized HLO opcodes.
OPCODES = {"all_reduce": "all-reduce", "all_gather": "all-gather", "all_to_all": "all-to-all",
           "reduce_scatter": "reduce-scatter"}


CI_CASES = ("vocab-tp", "hidden-replica", "replicated", "routed-tokens", "grid-fsdp-tp")


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=() if case in CI_CASES else pytest.mark.slow) for case in CASES])
def test_lookup_and_gradient_compile(case):
  shape, names, strategy, table_axes, data_axes, collectives = CASES[case]
  mesh = deviceless.gpu_mesh(shape, names, target="H100")
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    emb = nnx.eval_shape(lambda: embedlib.ShardedEmbed(
        1000, 256, mesh=mesh, sharding=strategy, table_axes=table_axes,
        data_axes=data_axes, kernel="pallas", rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(emb)
  ids = jax.ShapeDtypeStruct((64, 4), jnp.int32,
                             sharding=NamedSharding(mesh, P(emb.plan.data_axes or None)))

  def lookup_and_grad(s, i):
    forward = lambda s: nnx.merge(graphdef, s)(i)
    rows, vjp = jax.vjp(forward, s)
    return rows, vjp(2 * rows)

  program = compiled.compile_checked(case, lookup_and_grad, compiled.abstract(state, mesh), ids,
                                     mesh=mesh)
  compiled.check_all(program, kernels=("embedlib_gather_mosaic", "embedlib_segment_sum_mosaic"),
                     collectives_=[OPCODES[c] for c in collectives])
