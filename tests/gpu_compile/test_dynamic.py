"""A dynamic table's train step compiles for 8 H200s without a device, with no spills.

The map's step (ids routed to their owners by all-to-all, the sort of the
step's ids, bucket scan, placement, the victims' sort, resets of placed
rows) inside the owners' ``shard_map``, then the rows' lookup (XLA's
gather: ``kernel="auto"`` on a GPU) and the sorted row-wise update.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import embedlib
from embedlib import dynamic, optim
from embedlib.kernels import deviceless
from tests.gpu_compile import compiled
from tests.gpu_compile.test_sparse_step import abstract_state


def test_dynamic_step_compiles():
  mesh = deviceless.gpu_mesh((8,), ("x",), target="H200")

  def build():
    emb = embedlib.DynamicEmbed(8 * 1024, 128, bucket_size=128, eviction="lru", admit_after=2,
                                mesh=mesh, rngs=nnx.Rngs(0))
    return emb, optim.SparseAwareOptimizer(emb, None, optim.RowWiseAdagrad(0.1))

  graphdef, state = abstract_state(build, mesh)
  emb_state = state[0]
  for field in ("keys_hi", "keys_lo", "score", "placed_at", "sketch"):   # no device holds the map
    assert emb_state[field].get_value().sharding.spec[0] == "x", field
  words = dynamic.Words(jax.ShapeDtypeStruct((512, 2), jnp.uint32,
                                             sharding=NamedSharding(mesh, P("x"))))

  def step(state, words):
    emb, opt = nnx.merge(graphdef, state)
    loss, grads = optim.value_and_grad(lambda m: jnp.sum(m(words) ** 2))(emb)
    dynamic.reset_slots(opt, emb)
    opt.update(emb, grads)
    return loss, nnx.state((emb, opt))

  program = compiled.compile_checked("dynamic", step, state, words, mesh=mesh, target="H200",
                                     donate_argnums=0)
  compiled.check_all(program, kernels=(),
                     collectives_=("all-to-all", "all-reduce"))
  assert "sort(" in program.text
  # The map, rows and slots are written in place: what is not is scalars and the stats.
  memory = program.memory
  assert memory.output_size_in_bytes - memory.alias_size_in_bytes <= 256
