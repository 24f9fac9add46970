"""The CPU kernels built for x86-64-v3 (AVX2) give the baseline build's bits.

``cpu_library.isa_flags`` builds the library with ``-march=x86-64-v3`` where
the CPU has AVX2. Its loops then run 8 floats at a time, and nothing else
may change: every operation stays element by element (no fused multiply-add,
no reordered sum), so each row's result must be the same bits as the
baseline (SSE2) build's. Here the baseline build runs in a subprocess, with
its own cache, and this process runs the AVX2 build; every rule of the
fused update (columns a multiple of the vector width and not), the gather
the pooled bags and the dot interaction (forward and backward) must agree bit
for bit.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import embedlib
from embedlib import optim
from embedlib.kernels import bag_cpu, cpu_library, gather_cpu, interaction

from ..cpu_kernels import require_cpu_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = 300
IDS = 16_384  # enough for both of XLA's threads (row_update.cc: kIdsPerWorker)


def _rules():
  return {"sgd": optim.SparseSGD(0.1), "adagrad": optim.RowWiseAdagrad(0.1),
          "adam_row": optim.LazyAdam(0.01), "adam_global": optim.LazyAdam(0.01, bias_correction="global")}


def outputs() -> dict[str, np.ndarray]:
  """Every kernel's results on fixed inputs, by name (run in both processes)."""
  rng = np.random.default_rng(0)
  ids = jnp.asarray((rng.zipf(1.2, IDS) * 7919) % (ROWS + 20) - 10, jnp.int32)  # some invalid
  out = {}
  for features in (64, 37):
    plan = embedlib.plan_embedding(ROWS, features)
    table = jnp.asarray(rng.normal(size=(ROWS, features)), jnp.float32)
    grads = jnp.asarray(rng.normal(size=(IDS, features)) * 1e-2, jnp.float32)
    for name, rule in _rules().items():
      step = jax.jit(lambda t, s, i, g, n, rule=rule, plan=plan: optim.apply_row_grads(
          rule, t, s, [(i, g)], plan=plan, mesh=None, step=n))
      t, s = table, optim.init_slots(rule, plan, None)
      for n in range(2):
        t, s = step(t, s, ids, grads * (n + 1), n)
      out[f"{name}_{features}"] = np.asarray(t)
      out.update({f"{name}_{features}_{k}": np.asarray(v) for k, v in s.items()})
    out[f"gather_{features}"] = np.asarray(jax.jit(gather_cpu.gather_cpu)(table, ids))
    bags = ids[: IDS // 8 * 8].reshape(-1, 8)
    weights = jnp.asarray(rng.uniform(size=bags.shape), jnp.float32)
    for combiner in ("sum", "mean", "sqrtn"):
      out[f"bag_{combiner}_{features}"] = np.asarray(jax.jit(
          lambda t, b, w, c=combiner: bag_cpu.bag_cpu(t, b, w, combiner=c))(table, bags, weights))
    vectors = [jnp.asarray(rng.normal(size=(64, features)), jnp.float32) for _ in range(27)]
    cot = jnp.asarray(rng.normal(size=(64, 27 * 26 // 2)), jnp.float32)
    # Differentiated, so that the kernel runs forward as well as backward.
    value, grads = jax.jit(jax.value_and_grad(
        lambda v, c: jnp.sum(interaction.dot_pairs(v) * c)))(vectors, cot)
    out[f"interaction_{features}"] = np.asarray(value)
    out[f"interaction_grads_{features}"] = np.stack(grads)
  return out


def test_the_avx2_build_gives_the_baseline_builds_bits(tmp_path):
  require_cpu_kernels()
  if not cpu_library.isa_flags(cpu_library.compiler()):
    pytest.skip("this CPU (or compiler) has no x86-64-v3: the library is the baseline build")
  assert optim.fused_cpu.enabled()
  saved = tmp_path / "baseline.npz"
  code = ("import numpy as np\n"
          "from embedlib.kernels import cpu_library\n"
          "cpu_library.isa_flags = lambda cxx: ()\n"
          "assert '-march=x86-64-v3' not in cpu_library.flags(cpu_library.compiler())\n"
          "from tests.kernels import test_cpu_isa as t\n"
          f"np.savez({str(saved)!r}, **t.outputs())\n")
  env = dict(os.environ, EMBEDLIB_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=600)
  baseline = np.load(saved)
  built = list((tmp_path / "cache").glob("cpu_kernels-*.so"))
  assert len(built) == 1 and built[0].name != cpu_library.library()._name.rsplit("/", 1)[-1]
  avx2 = outputs()
  assert sorted(baseline.files) == sorted(avx2)
  for name, want in avx2.items():
    np.testing.assert_array_equal(baseline[name], want, err_msg=name)


@pytest.mark.parametrize("cpu, compiler_ok, want", [
    ("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave sse4_2", True, ("-march=x86-64-v3",)),
    ("avx bmi1 bmi2 f16c fma abm movbe xsave sse4_2", True, ()),   # no AVX2
    ("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave sse4_2", False, ()),  # a compiler without it
])
def test_the_isa_level_follows_the_cpu_and_the_compiler(cpu, compiler_ok, want, tmp_path,
                                                        monkeypatch):
  cpuinfo = tmp_path / "cpuinfo"
  cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {cpu}\n")
  flags = cpu_library._cpu_flags(str(cpuinfo))
  assert flags == frozenset(cpu.split())
  monkeypatch.setattr(cpu_library, "_cpu_flags", lambda: flags)
  monkeypatch.setattr(cpu_library.platform, "machine", lambda: "x86_64")
  cxx = tmp_path / "c++"
  cxx.write_text(f"#!/bin/sh\nexit {0 if compiler_ok else 1}\n")
  cxx.chmod(0o755)
  cpu_library.isa_flags.cache_clear()
  try:
    assert cpu_library.isa_flags(str(cxx)) == want
    assert cpu_library.flags(str(cxx))[:len(want)] == want
  finally:
    cpu_library.isa_flags.cache_clear()
