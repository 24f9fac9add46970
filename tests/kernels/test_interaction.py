"""DLRM's dot interaction through the C++ kernel (``kernels/interaction.py``) against XLA's pairs.

The kernel runs where the interaction is differentiated, forward and
backward, and sums each dot product and each gradient in another order than
XLA's fusions: the two agree to float32 rounding at widths the kernel
specializes (16, 64, 128) and others (37), for 2 to 27 vectors and any
batch, empty included. Evaluated alone (what serving exports) the
interaction is XLA's pairs, bit for bit. Where the kernel may not run
(vectors on several devices, another dtype, the switch off, a CUDA
lowering), the training program holds XLA's pairs alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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


@pytest.mark.parametrize("case", ["several devices", "bfloat16", "switched off", "one vector"])
def test_where_the_kernel_may_not_run_the_program_holds_xlas_pairs(case, monkeypatch):
  require_cpu_kernels()
  vectors = _vectors(1 if case == "one vector" else 3, 4, 8,
                     jnp.bfloat16 if case == "bfloat16" else jnp.float32)
  if case == "switched off":
    monkeypatch.setenv("EMBEDLIB_CPU_KERNELS", "0")
  if case == "one vector":  # no pair: nothing to call the kernel for
    assert not interaction.kernel_applies(vectors)
    return
  loss = lambda v: jnp.sum(interaction.dot_pairs(v, cpu_kernel=case != "several devices"))
  text = jax.jit(jax.value_and_grad(loss)).lower(vectors).as_text()
  assert "embedlib_interaction" not in text and "multiply" in text


def test_a_cuda_lowering_holds_xlas_pairs():
  vectors = [jax.ShapeDtypeStruct((4, 8), jnp.float32)] * 3
  cot = jax.ShapeDtypeStruct((4, 3), jnp.float32)
  text = lowering.cuda_lowering_text(jax.value_and_grad(_loss), vectors, cot)
  assert "embedlib_interaction" not in text and "multiply" in text


@pytest.mark.parametrize("devices", [1, 2])
def test_dlrm_trains_through_the_kernel_where_its_batch_lies_on_one_device(devices):
  require_cpu_kernels()
  if jax.device_count() < devices:
    pytest.skip(f"needs {devices} devices")
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
  model = DLRM(num_dense=2, tables=[TableSpec("a", 16, 8)],
               features=[FeatureSpec("a", "a"), FeatureSpec("b", "a")],
               bottom_sizes=(8,), top_sizes=(4, 1), mesh=mesh, rngs=nnx.Rngs(0))
  dense, sparse = jnp.ones((4, 2)), {"a": jnp.arange(4), "b": jnp.arange(4) + 4}
  graph, state = nnx.split(model)
  loss = lambda s: jnp.sum(nnx.merge(graph, s)(dense, sparse))
  text = jax.jit(jax.value_and_grad(loss)).lower(state).as_text()
  assert (FORWARD in text and BACKWARD in text) == (devices == 1)


def test_the_benchmark_checks_then_times_both(tmp_path):
  require_cpu_kernels()
  script = benchmark_scripts.load("interaction")
  path = tmp_path / "run.json"
  assert script.main(["--quick", "--repeats", "1", "--json", str(path)]) == 0
  record = benchmark_scripts.read_record(
      path, ["xla_over_kernel_forward", "xla_over_kernel_training"])
  assert {c["name"] for c in record["cases"]} == {
      f"{part}, {kind}" for part in ("forward", "training") for kind in ("kernel", "XLA pairs")}
