"""The sparse train step's GPU path builds: lowered for CUDA without a GPU.

The whole step (Pallas lookup, row gradients, sorted dedup, row-wise update
inside ``shard_map`` writing distinct rows only, by the fused Mosaic GPU
kernel where it applies, donated state) with ``kernel="pallas"`` and
``fused_gpu.use(True)`` (the default, ``"auto"``, runs XLA's ops on a GPU,
measured faster: `test_the_default_step_lowers_to_xla_ops`) for a ``ShardedEmbed`` of every
strategy (row-wise AdaGrad; SGD and both LazyAdams on a row- and a
column-sharded table) and for an ``EmbeddingCollection``, through an abstract H200 mesh
(``embedlib.kernels.lowering``). Also the regression test for building
slots on an ``AbstractMesh`` (``AbstractMesh.devices`` raises ValueError).
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import embedlib
from embedlib import EmbeddingCollection, FeatureSpec, TableSpec, optim
from embedlib import kernels
from embedlib.kernels import lowering
from embedlib.optim import fused_gpu
from embedlib.plan import plan_embedding

# The compiled kernel kernel="pallas" puts in a CUDA lowering on this jax.
GPU_CALL = {"mosaic": lowering.MOSAIC_GPU_CALL, "triton": lowering.TRITON_CALL}[
    kernels.pallas_backend()]

# (mesh shape, names, strategy)
CASES = {
    "vocab-tp": ((2, 4), ("data", "model"), "vocab"),
    "hidden-tp": ((2, 4), ("data", "model"), "hidden"),
    "grid-tp": ((2, 4), ("data", "model"), "grid"),   # rows over model, columns over data
    "replicated": ((2, 4), ("data", "model"), "replicated"),
    "vocab-tokens": ((8,), ("batch",), "vocab"),
    "routed-tokens": ((8,), ("batch",), "routed"),
}


def abstract_state(build, mesh):
  """Builds ``(module, optimizer)`` abstractly on ``mesh``; returns graphdef, state."""
  with lowering.lowering_context(mesh):
    pair = nnx.eval_shape(build)
  graphdef, state = nnx.split(pair)
  return graphdef, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_no_colliding_scatter(text):
  """Every scatter of the step writes distinct indices (no atomics on a GPU)."""
  scatters = [line for line in text.splitlines() if "stablehlo.scatter" in line]
  assert scatters, "the update writes its rows with scatters"
  assert all("unique_indices = true" in line for line in scatters), scatters


def assert_fused_update(text):
  """Where the fused kernel takes the table, it writes the rows: no scatter adds into them."""
  with fused_gpu.use(True):
    fused = fused_gpu.supports(optim.RowWiseAdagrad(0.1), jnp.zeros((8, 256)),
                               plan_embedding(1000, 256))   # float32, whole 16-byte rows
  if not fused:   # jax 0.10: the XLA ops
    assert "embedlib_fused_update_mosaic" not in text
    return
  assert "embedlib_fused_update_mosaic" in text
  scatters = re.findall(r'"stablehlo\.scatter"(.*?)\}\) :', text, re.S)
  assert scatters and not [s for s in scatters if "stablehlo.add" in s], scatters


def lower_step(graphdef, state, inputs, loss_fn, mesh, fused=True):
  """The step lowered for CUDA, with the fused update (``fused_gpu.use``) or the default."""
  def step(state, inputs):
    module, opt = nnx.merge(graphdef, state)
    loss, grads = optim.value_and_grad(lambda m: loss_fn(m, inputs))(module)
    opt.update(module, grads)
    return loss, nnx.state((module, opt))

  with fused_gpu.use(True) if fused else contextlib.nullcontext():
    return lowering.cuda_lowering_text(step, state, inputs, mesh=mesh, donate_argnums=0)


RULES = {"sgd": optim.SparseSGD(0.1), "adagrad": optim.RowWiseAdagrad(0.1),
         "adam": optim.LazyAdam(0.1), "adam-global": optim.LazyAdam(0.1, bias_correction="global")}


@pytest.mark.parametrize("case,rule", [(case, "adagrad") for case in CASES] + [
    (case, rule) for case in ("vocab-tp", "hidden-tp") for rule in RULES if rule != "adagrad"])
def test_sparse_step_lowers_for_cuda(case, rule):
  text = lower_embed_step(case, rule, "pallas")
  assert GPU_CALL in text, case          # the Pallas lookup
  assert "stablehlo.scatter" in text, case           # the row-wise update
  assert "all_gather" in text, case                  # every rank sees the batch's ids
  assert "jax.buffer_donor" in text or "tf.aliasing_output" in text, case  # donated state
  assert "custom_call @embedlib_" not in text, case  # no fused CPU update (fused_cpu.py)
  assert_no_colliding_scatter(text)                   # the sorted update (sorted_update.py)
  assert_fused_update(text)                           # its Mosaic GPU kernel (fused_gpu.py)


def test_the_default_step_lowers_to_xla_ops():
  """``kernel="auto"`` and the default update: XLA's gather and the sorted update's XLA ops."""
  text = lower_embed_step("vocab-tp", "adagrad", "auto", fused=False)
  assert GPU_CALL not in text and "embedlib_fused_update_mosaic" not in text
  assert "custom_call @embedlib_" not in text   # nor a CPU kernel
  assert_no_colliding_scatter(text)


def lower_embed_step(case, rule, kernel, fused=True):
  """The sparse step of one ``ShardedEmbed`` of ``CASES[case]``, lowered for CUDA."""
  shape, names, strategy = CASES[case]
  mesh = lowering.gpu_abstract_mesh(shape, names)

  def build():
    # 256 wide: every local slice of whole 16-byte rows, as Mosaic GPU needs.
    emb = embedlib.ShardedEmbed(1000, 256, mesh=mesh, sharding=strategy, kernel=kernel,
                                rngs=nnx.Rngs(0))
    return emb, optim.SparseAwareOptimizer(emb, None, RULES[rule])

  graphdef, state = abstract_state(build, mesh)
  emb = nnx.merge(graphdef, state)[0]
  ids = jax.ShapeDtypeStruct((64, 4), jnp.int32,
                             sharding=NamedSharding(mesh, P(emb.plan.data_axes or None)))
  return lower_step(graphdef, state, ids, lambda m, i: jnp.sum(m(i) ** 2), mesh, fused=fused)


def test_collection_sparse_step_lowers_for_cuda():
  mesh = lowering.gpu_abstract_mesh((8,), ("batch",))

  def build():
    # "day", replicated, all-reduces its rows' summed gradients (allreduce.py).
    coll = EmbeddingCollection(
        [TableSpec("item", 3000, 64), TableSpec("country", 20, 16),
         TableSpec("day", 7, 16, sharding="replicated")],
        [FeatureSpec("clicks", "item", combiner="sum"),
         FeatureSpec("country", "country", max_ids_per_sample=1),
         FeatureSpec("day", "day", max_ids_per_sample=1)],
        mesh=mesh, kernel="pallas", replicate_below_bytes=0, rngs=nnx.Rngs(0))
    return coll, optim.SparseAwareOptimizer(coll, None, optim.RowWiseAdagrad(0.1))

  graphdef, state = abstract_state(build, mesh)
  batch = NamedSharding(mesh, P("batch"))
  features = {"clicks": jax.ShapeDtypeStruct((64, 8), jnp.int32, sharding=batch),
              "country": jax.ShapeDtypeStruct((64,), jnp.int32, sharding=batch),
              "day": jax.ShapeDtypeStruct((64,), jnp.int32, sharding=batch)}
  loss = lambda c, f: sum(jnp.sum(v**2) for v in c(f).values())
  text = lower_step(graphdef, state, features, loss, mesh)
  assert text.count(GPU_CALL) >= 2       # one pooled lookup per table
  assert "stablehlo.scatter" in text and "all_gather" in text
  # "day"'s rows' summed gradients and hit counts, [7, 16 + 1], all-reduced.
  reduced = re.findall(r'all_reduce"\(%\d+\)[\s\S]*?\}\) : \((tensor<[^>]*>)', text)
  assert "tensor<7x17xf32>" in reduced, reduced
  assert_no_colliding_scatter(text)
  assert_fused_update(text)
