"""One program for CPU and CUDA: each platform's kernel is chosen when it is lowered.

A lookup, a sparse train step (``optim.value_and_grad`` +
``SparseAwareOptimizer``) and a DLRM train step are traced once on an
abstract H200 mesh and exported for ``("cpu", "cuda")`` with
``kernel="auto"`` as where `gpu_choice` lists no shape (the fixture
``auto_runs_pallas_on_gpu``: every measured shape now runs XLA's ops on a
GPU). Lowered for CUDA alone the step holds the Pallas GPU
kernel and none of the CPU's C++ calls; lowered for the CPU alone, the
reverse; the exported module holds both. Serialized, read back and run on
this machine's 8 CPU devices, it gives what the step jitted on the CPU mesh
with ``kernel="xla"`` gives (exactly for the lookup; to float32 rounding for
the steps, whose CPU update may be the fused C++ one).
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

import embedlib
from embedlib import optim
from embedlib.data.spec import DataSpec, SparseFeature
from embedlib.kernels import cpu_library, lowering
from embedlib.models import build_model

GPU_CALLS = (lowering.TRITON_CALL, lowering.MOSAIC_GPU_CALL)

pytestmark = pytest.mark.usefixtures("auto_runs_pallas_on_gpu")
CPU_CALLS = tuple(f"custom_call @{t}" for t in cpu_library.TARGETS)
# The CPU's FFI targets are this library's own, and Triton IR has no
# stability guarantee: export refuses both unless told, as the library says.
CHECKS = embedlib.export_disabled_checks()


def test_plain_export_names_the_custom_calls_and_the_library_checks_let_it_through():
  embed = embedlib.ShardedEmbed(1000, 16, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(embed)
  lookup = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
  ids = jnp.array([[1, 5], [7, 999]], dtype=jnp.int32)
  if cpu_library.available():  # else the lookup is XLA's gather and holds no custom call
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
      export.export(lookup)(state, ids)
  exported = export.export(lookup, disabled_checks=CHECKS)(state, ids)
  assert "embedlib_gather" in exported.mlir_module() or not cpu_library.available()
  np.testing.assert_array_equal(exported.call(state, ids), embed(ids))


def split_abstract(build, mesh):
  """``build(mesh)`` traced abstractly: its graphdef, treedef and abstract leaves."""
  with lowering.lowering_context(mesh):
    module = nnx.eval_shape(lambda: build(mesh))
  graphdef, state = nnx.split(module)
  leaves, treedef = jax.tree.flatten(state)
  return graphdef, treedef, [
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]


def export_both(fn, *args, mesh):
  """``fn`` exported for CPU and CUDA, after checking each platform's own lowering."""
  with lowering.lowering_context(mesh):
    traced = jax.jit(fn).trace(*args)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    exported = export.export(jax.jit(fn), platforms=("cpu", "cuda"), disabled_checks=CHECKS)(*args)
  assert any(c in cuda for c in GPU_CALLS), "no Pallas GPU kernel in the CUDA lowering"
  assert not any(c in cuda for c in CPU_CALLS), "a CPU kernel in the CUDA lowering"
  assert not any(c in cpu for c in GPU_CALLS), "a GPU kernel in the CPU lowering"
  text = exported.mlir_module()
  assert any(c in text for c in GPU_CALLS)
  if cpu_library.available():
    assert any(c in cpu for c in CPU_CALLS) and any(c in text for c in CPU_CALLS)
  assert exported.platforms == ("cpu", "cuda")
  return export.deserialize(exported.serialize())


def cpu_mesh(shape, names, axis_type=jax.sharding.AxisType.Explicit):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def ids_on(mesh, shape, vocab, spec, seed=0):
  ids = np.random.default_rng(seed).integers(-3, vocab + 3, shape).astype(np.int32)
  return jax.device_put(jnp.asarray(ids), NamedSharding(mesh, spec))


@pytest.mark.parametrize("strategy", ["vocab", "hidden"])
def test_exported_lookup_runs_back_on_cpu(strategy):
  shape, names = (2, 4), ("data", "model")
  build = lambda mesh, kernel="auto": embedlib.ShardedEmbed(
      1000, 64, mesh=mesh, sharding=strategy, kernel=kernel, rngs=nnx.Rngs(0))
  am = lowering.gpu_abstract_mesh(shape, names)
  graphdef, treedef, leaves = split_abstract(build, am)
  ids_spec = P("data")

  def lookup(leaves, ids):
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(ids)

  ids_abstract = jax.ShapeDtypeStruct((64, 4), jnp.int32, sharding=NamedSharding(am, ids_spec))
  exported = export_both(lookup, leaves, ids_abstract, mesh=am)

  mesh = cpu_mesh(shape, names)
  emb = build(mesh, "xla")
  ids = ids_on(mesh, (64, 4), 1000, ids_spec)
  got = exported.call(jax.tree.leaves(nnx.state(emb)), ids)
  np.testing.assert_array_equal(got, jax.jit(emb)(ids))


class Model(nnx.Module):
  """The README's sparse example: one table, a dense head."""

  def __init__(self, mesh, kernel, rngs):
    self.emb = embedlib.ShardedEmbed(500, 16, mesh=mesh, sharding="vocab", kernel=kernel,
                                     rngs=rngs)
    self.head = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, ids):
    return self.head(self.emb(ids).sum(axis=1))[:, 0]


def sparse_step(graphdef, treedef, loss_fn):
  def step(leaves, batch):
    model, opt = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    loss, grads = optim.value_and_grad(lambda m: loss_fn(m, batch))(model)
    opt.update(model, grads)
    return loss, jax.tree.leaves(nnx.state((model, opt)))

  return step


def check_exported_step(build, batch_abstract, make_batch, loss_fn, shape, names):
  # Auto axes: the dense layers' gradients need no sharding annotations.
  auto = jax.sharding.AxisType.Auto
  am = lowering.gpu_abstract_mesh(shape, names, axis_types=(auto,) * len(shape))
  graphdef, treedef, leaves = split_abstract(lambda m: build(m, "auto"), am)
  exported = export_both(sparse_step(graphdef, treedef, loss_fn), leaves,
                         batch_abstract(am), mesh=am)

  mesh = cpu_mesh(shape, names, auto)
  graphdef, state = nnx.split(build(mesh, "xla"))
  leaves = jax.tree.leaves(state)
  batch = make_batch(mesh)
  want_loss, want = jax.jit(sparse_step(graphdef, jax.tree.structure(state), loss_fn))(
      leaves, batch)
  got_loss, got = exported.call(leaves, batch)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-7)


def test_exported_sparse_train_step_runs_back_on_cpu():
  def build(mesh, kernel):
    model = Model(mesh, kernel, nnx.Rngs(0))
    return model, optim.SparseAwareOptimizer(model, optax.sgd(0.1), optim.RowWiseAdagrad(0.5))

  def loss_fn(model, batch):
    return jnp.mean((model(batch["ids"]) - batch["y"]) ** 2)

  spec = P("data")
  batch_abstract = lambda m: {
      "ids": jax.ShapeDtypeStruct((32, 3), jnp.int32, sharding=NamedSharding(m, spec)),
      "y": jax.ShapeDtypeStruct((32,), jnp.float32, sharding=NamedSharding(m, spec))}
  make_batch = lambda m: {
      "ids": ids_on(m, (32, 3), 500, spec),
      "y": jax.device_put(jnp.linspace(-1.0, 1.0, 32), NamedSharding(m, spec))}
  check_exported_step(build, batch_abstract, make_batch, loss_fn, (2, 4), ("data", "model"))


def test_exported_dlrm_train_step_runs_back_on_cpu():
  spec = DataSpec(3, (SparseFeature("user", 300), SparseFeature("item", 40, bag_size=4)))

  def build(mesh, kernel):
    cfg = ml_collections.ConfigDict(dict(
        name="dlrm", embed_dim=8, bottom_sizes=(16,), top_sizes=(16, 1), combiner="mean",
        num_unique=None, kernel=kernel, cross_layers=1, replicate_below_bytes=0))
    model = build_model(cfg, spec, mesh=mesh, batch_size=32, rngs=nnx.Rngs(0))
    return model, optim.SparseAwareOptimizer(model, optax.adam(1e-2), optim.LazyAdam(1e-2))

  def loss_fn(model, batch):
    logits = model(batch["dense"], batch["sparse"])
    return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()

  row = lambda m: NamedSharding(m, P("batch"))
  batch_abstract = lambda m: {
      "dense": jax.ShapeDtypeStruct((32, 3), jnp.float32, sharding=row(m)),
      "sparse": {"user": jax.ShapeDtypeStruct((32,), jnp.int32, sharding=row(m)),
                 "item": jax.ShapeDtypeStruct((32, 4), jnp.int32, sharding=row(m))},
      "label": jax.ShapeDtypeStruct((32,), jnp.float32, sharding=row(m))}

  def make_batch(m):
    rng = np.random.default_rng(1)
    put = lambda x: jax.device_put(jnp.asarray(x), row(m))
    return {"dense": put(rng.standard_normal((32, 3)).astype(np.float32)),
            "sparse": {"user": ids_on(m, (32,), 300, P("batch"), seed=2),
                       "item": ids_on(m, (32, 4), 40, P("batch"), seed=3)},
            "label": put((rng.random(32) < 0.5).astype(np.float32))}

  check_exported_step(build, batch_abstract, make_batch, loss_fn, (8,), ("batch",))
