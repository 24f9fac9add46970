"""DLRM's dot interaction through the C++ kernel (``kernels/interaction.py``) against XLA's pairs.

The kernel runs where the interaction is differentiated, forward and
backward, and sums each dot product and each gradient in another order than
XLA's fusions: the two agree to float32 rounding at widths the kernel
specializes (16, 64, 128) and others (37), for 2 to 27 vectors and any
batch, empty included. Evaluated alone (what serving exports) the
interaction is XLA's pairs, bit for bit. On a mesh, each device runs the
kernel on its part of the batch (padded to the data shards). Where the
kernel may not run (a mesh without a data axis or with an Explicit one,
another dtype, the switch off, a CUDA lowering), the training program
holds XLA's pairs alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

import embedlib
from embedlib import FeatureSpec, TableSpec
from embedlib.kernels import interaction, lowering
from embedlib.models import DLRM

from tests import benchmark_scripts

from ..cpu_kernels import require_cpu_kernels

FORWARD, BACKWARD = "embedlib_interaction(", "embedlib_interaction_backward("


def _vectors(n, batch, width, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal((batch, width)), dtype) for _ in range(n)]


def _pairs_and_grads(pairs):
  """(the pairs as differentiated, the gradients of sum(pairs * cot))."""
  def run(vectors, cot):
    out, vjp = jax.vjp(pairs, vectors)
    return out, vjp(cot)[0]
  return jax.jit(run)


@pytest.mark.parametrize("n, batch, width", [
    (2, 5, 64), (3, 1, 37), (27, 33, 64), (4, 0, 16), (5, 9, 128), (27, 70, 37)])
def test_the_kernel_gives_xlas_pairs_and_gradients(n, batch, width):
  require_cpu_kernels()
  vectors = _vectors(n, batch, width)
  cot = jnp.asarray(np.random.default_rng(1).standard_normal((batch, n * (n - 1) // 2)),
                    jnp.float32)
  (out, grads), (want, want_grads) = (
      _pairs_and_grads(f)(vectors, cot) for f in (interaction.dot_pairs, interaction.pairs_xla))
  assert out.shape == (batch, n * (n - 1) // 2) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)
  # Evaluated alone: XLA's pairs, bit for bit.
  np.testing.assert_array_equal(jax.jit(interaction.dot_pairs)(vectors),
                                jax.jit(interaction.pairs_xla)(vectors))


def _loss(vectors, cot):
  return jnp.sum(interaction.dot_pairs(vectors) * cot)


def test_a_training_program_runs_the_kernel_and_a_prediction_xlas_pairs():
  require_cpu_kernels()
  vectors, cot = _vectors(3, 4, 8), jnp.ones((4, 3))
  text = jax.jit(jax.value_and_grad(_loss)).lower(vectors, cot).as_text()
  assert FORWARD in text and BACKWARD in text
  assert "embedlib_interaction" not in jax.jit(interaction.dot_pairs).lower(vectors).as_text()


def _mesh(devices, axis="data", axis_type=jax.sharding.AxisType.Auto):
  if jax.device_count() < devices:
    pytest.skip(f"needs {devices} devices")
  return jax.make_mesh((devices,), (axis,), axis_types=(axis_type,),
                       devices=jax.devices()[:devices])


@pytest.mark.parametrize("case", [
    "no data axis", "an Explicit data axis", "bfloat16", "switched off", "one vector"])
def test_where_the_kernel_may_not_run_the_program_holds_xlas_pairs(case, monkeypatch):
  require_cpu_kernels()
  vectors = _vectors(1 if case == "one vector" else 3, 4, 8,
                     jnp.bfloat16 if case == "bfloat16" else jnp.float32)
  mesh = None
  if case == "no data axis":
    mesh = _mesh(2, "model")
  if case == "an Explicit data axis":
    mesh = _mesh(2, axis_type=jax.sharding.AxisType.Explicit)
  if case == "switched off":
    monkeypatch.setenv("EMBEDLIB_CPU_KERNELS", "0")
  if case == "one vector":  # no pair: nothing to call the kernel for
    assert not interaction.kernel_applies(vectors)
    return
  loss = lambda v: jnp.sum(interaction.dot_pairs(v, mesh=mesh))
  text = jax.jit(jax.value_and_grad(loss)).lower(vectors).as_text()
  assert "embedlib_interaction" not in text and "multiply" in text


@pytest.mark.parametrize("batch", [8, 5, 0])
def test_on_a_data_axis_each_device_runs_the_kernel_on_its_part(batch):
  """Batches that do and don't divide the 4 shards, and none: padded with zero rows, then cut."""
  require_cpu_kernels()
  mesh = _mesh(4)
  vectors = _vectors(4, batch, 16)
  cot = jnp.asarray(np.random.default_rng(1).standard_normal((batch, 6)), jnp.float32)
  sharded = lambda v: interaction.dot_pairs(v, mesh=mesh)
  (out, grads), (want, want_grads) = (
      _pairs_and_grads(f)(vectors, cot) for f in (sharded, interaction.pairs_xla))
  assert out.shape == (batch, 6)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
  for g, w in zip(grads, want_grads):
    assert g.shape == (batch, 16)
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)
  text = jax.jit(jax.value_and_grad(
      lambda v, c: jnp.sum(sharded(v) * c))).lower(vectors, cot).as_text()
  assert FORWARD in text and BACKWARD in text and "all-gather" not in text.replace("_", "-")


def test_a_cuda_lowering_holds_xlas_pairs():
  vectors = [jax.ShapeDtypeStruct((4, 8), jnp.float32)] * 3
  cot = jax.ShapeDtypeStruct((4, 3), jnp.float32)
  text = lowering.cuda_lowering_text(jax.value_and_grad(_loss), vectors, cot)
  assert "embedlib_interaction" not in text and "multiply" in text


@pytest.mark.parametrize("axis", ["data", "model"])
def test_dlrm_trains_through_the_kernel_where_its_batch_is_split_over_data_axes(axis):
  require_cpu_kernels()
  mesh = _mesh(2, axis)
  model = DLRM(num_dense=2, tables=[TableSpec("a", 16, 8)],
               features=[FeatureSpec("a", "a"), FeatureSpec("b", "a")],
               bottom_sizes=(8,), top_sizes=(4, 1), mesh=mesh, rngs=nnx.Rngs(0))
  dense, sparse = jnp.ones((4, 2)), {"a": jnp.arange(4), "b": jnp.arange(4) + 4}
  graph, state = nnx.split(model)
  loss = lambda s: jnp.sum(nnx.merge(graph, s)(dense, sparse))
  text = jax.jit(jax.value_and_grad(loss)).lower(state).as_text()
  # A mesh without a data axis ("model": the tables split, the batch whole) keeps XLA's pairs.
  assert (FORWARD in text and BACKWARD in text) == (axis == "data")


def test_the_benchmark_checks_then_times_both(tmp_path):
  require_cpu_kernels()
  script = benchmark_scripts.load("interaction")
  path = tmp_path / "run.json"
  assert script.main(["--quick", "--repeats", "1", "--json", str(path)]) == 0
  record = benchmark_scripts.read_record(
      path, ["xla_over_kernel_forward", "xla_over_kernel_training"])
  assert {c["name"] for c in record["cases"]} == {
      f"{part}, {kind}" for part in ("forward", "training") for kind in ("kernel", "XLA pairs")}


def test_a_dlrm_under_set_mesh_checks_its_ids_and_trains_through_the_kernel():
  """checkify's checks (a dedup capacity's on_overflow="error") before the interaction's shard_map."""
  require_cpu_kernels()
  mesh = _mesh(2)
  with jax.set_mesh(mesh):
    model = DLRM(num_dense=2, tables=[TableSpec("a", 16, 8)],
                 features=[FeatureSpec("a", "a"), FeatureSpec("b", "a")],
                 bottom_sizes=(8,), top_sizes=(4, 1), rngs=nnx.Rngs(0),
                 layout=embedlib.CollectionLayout(num_unique=2, on_overflow="error",
                                                  replicate_below_bytes=0))
    graph, state = nnx.split(model)
    loss = lambda s, sparse: jnp.sum(nnx.merge(graph, s)(jnp.ones((4, 2)), sparse))
    step = jax.jit(checkify.checkify(jax.value_and_grad(loss), errors=checkify.user_checks))
    same = {"a": jnp.zeros(4, jnp.int32), "b": jnp.ones(4, jnp.int32)}
    err, (value, _) = step(state, same)
    assert err.get() is None and np.isfinite(value)
    err, _ = step(state, {"a": jnp.arange(4), "b": jnp.arange(4) + 4})  # 4 a shard
    assert "more than num_unique=2" in err.get()
    assert FORWARD in step.lower(state, same).as_text()
