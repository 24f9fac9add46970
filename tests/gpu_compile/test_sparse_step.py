"""The sparse train step compiles for 8 H100s: every optimizer, and a collection of stacked tables.

The step of ``tests/optim/test_gpu_lowering.py``: Mosaic GPU lookup
(``kernel="pallas"``: ``"auto"`` runs XLA's gather on a GPU, measured
faster), row gradients, sorted dedup (XLA's sort: the deviceless compile
turns CUB's off, ``embedlib.kernels.deviceless``), the row-wise update by
the fused Mosaic GPU kernel where it applies (``fused_gpu.use(True)``: not
the default, measured slower), donated state. Each rule on a vocab-parallel
table; the collection holds two tables placed whole on one device (one
stack; a pooled and a one-hot feature) and a replicated one.

CI compiles the steps of row-wise AdaGrad and LazyAdam (the rule with
slots and per-run bias corrections); ``-m slow`` adds SGD and LazyAdam's
global bias correction, whose fused kernels CI compiles in
``test_kernels`` (the same kernel as LazyAdam's, for the global one), and
the collection, whose step CI lowers for CUDA
(``tests/optim/test_gpu_lowering.py``).
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import embedlib
from embedlib import EmbeddingCollection, FeatureSpec, TableSpec, optim
from embedlib.kernels import deviceless
from embedlib.optim import fused_gpu
from tests.gpu_compile import compiled
from tests.optim.test_gpu_lowering import RULES


def abstract_state(build, mesh):
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    pair = nnx.eval_shape(build)
  graphdef, state = nnx.split(pair)
  return graphdef, compiled.abstract(state, mesh)


def compile_step(name, graphdef, state, inputs, loss_fn, mesh, target="H100"):
  def step(state, inputs):
    module, opt = nnx.merge(graphdef, state)
    loss, grads = optim.value_and_grad(lambda m: loss_fn(m, inputs))(module)
    opt.update(module, grads)
    return loss, nnx.state((module, opt))

  return compiled.compile_checked(name, step, state, inputs, mesh=mesh, target=target,
                                  donate_argnums=0)


def assert_in_place(program, state):
  """The step writes its donated state in place: what it outputs beyond that is a few scalars."""
  memory = program.memory
  assert memory.alias_size_in_bytes > 0
  assert memory.output_size_in_bytes - memory.alias_size_in_bytes <= 64, program.name


@pytest.mark.parametrize("rule", [
    pytest.param(rule, marks=pytest.mark.slow if rule in ("sgd", "adam-global") else ())
    for rule in RULES])
def test_sparse_step_compiles_with_each_optimizer(rule):
  mesh = deviceless.gpu_mesh((2, 4), ("data", "model"), target="H100")

  def build():
    emb = embedlib.ShardedEmbed(1000, 256, mesh=mesh, sharding="vocab", kernel="pallas",
                                rngs=nnx.Rngs(0))
    return emb, optim.SparseAwareOptimizer(emb, None, RULES[rule])

  graphdef, state = abstract_state(build, mesh)
  ids = jax.ShapeDtypeStruct((64, 4), jnp.int32, sharding=NamedSharding(mesh, P("data")))
  with fused_gpu.use(True):
    program = compile_step(rule, graphdef, state, ids, lambda m, i: jnp.sum(m(i) ** 2), mesh)
  compiled.check_all(program, kernels=("embedlib_gather_mosaic", "embedlib_fused_update_mosaic"),
                     collectives_=("all-gather", "all-reduce"))
  assert "sort(" in program.text   # the sorted dedup, by XLA's sort kernel
  assert_in_place(program, state)


# The collection's step lowers for CUDA in CI (tests/optim/test_gpu_lowering.py);
# compiled with its stacked tables: -m slow.
@pytest.mark.slow
def test_collection_step_with_stacked_tables_compiles():
  mesh = deviceless.gpu_mesh((8,), ("batch",), target="H100")

  def build():
    coll = EmbeddingCollection(
        [TableSpec("a", 500, 32, sharding="table"), TableSpec("b", 700, 32, sharding="table"),
         TableSpec("day", 7, 16, sharding="replicated")],
        [FeatureSpec("a", "a", combiner="sum"), FeatureSpec("b", "b", max_ids_per_sample=1),
         FeatureSpec("day", "day", max_ids_per_sample=1)],
        mesh=mesh, kernel="pallas", replicate_below_bytes=0, rngs=nnx.Rngs(0))
    return coll, optim.SparseAwareOptimizer(coll, None, optim.RowWiseAdagrad(0.1))

  graphdef, state = abstract_state(build, mesh)
  batch = NamedSharding(mesh, P("batch"))
  features = {"a": jax.ShapeDtypeStruct((64, 8), jnp.int32, sharding=batch),
              **{f: jax.ShapeDtypeStruct((64,), jnp.int32, sharding=batch) for f in ("b", "day")}}
  loss = lambda c, f: sum(jnp.sum(v**2) for v in c(f).values())
  program = compile_step("collection", graphdef, state, features, loss, mesh)
  compiled.check_all(program, kernels=("embedlib_bag_mosaic", "embedlib_gather_mosaic"),
                     collectives_=("all-to-all", "all-reduce"))
  assert_in_place(program, state)
