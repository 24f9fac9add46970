"""The GPU benchmark scripts: their checks can fail, and without a GPU they measure nothing.

``gpu_session.sh --smoke`` runs the whole session (``gpu_lookup.py`` and
``gpu_steps.py``, each ``--smoke --check``) at tiny sizes with the kernels
interpreted, so that a GPU session does not spend its device time on a
script error: every check must pass and every timing run (exit 0); with a
wrong gather or bag reference the lookup check must fail and the script
exit 1 before timing anything. The runs share a compilation cache. Every
run uses this checkout's embedlib. No time is asserted.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from tests import benchmark_scripts

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_lookup.py"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return dict(
      os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
      JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


@pytest.mark.parametrize("script,flags", [("gpu_lookup.py", []), ("gpu_lookup.py", ["--check"]),
                                          ("gpu_steps.py", ["--check"])])
def test_gpu_scripts_measure_nothing_on_cpu(script, flags, env):
  result = subprocess.run(
      [sys.executable, str(SCRIPT.parent / script), *flags], env=env, capture_output=True,
      text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "measures nothing" in result.stdout
  assert "GB/s" not in result.stdout  # no table was printed


@pytest.mark.slow
def test_smoke_session_passes_its_checks_and_times_every_case(tmp_path, env):
  session = SCRIPT.parent / "gpu_session.sh"
  env = dict(env, PYTHON=sys.executable, OUT=str(tmp_path))
  result = subprocess.run(["bash", str(session), "--smoke"], env=env, capture_output=True,
                          text=True, timeout=1200)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
  log = (tmp_path / "gpu_session.txt").read_text()
  assert "MISMATCH" not in log and "DIFFERS" not in log
  # Every backend's lookups, the backward, the update and both steps were timed.
  for backend in ("mosaic", "triton", "xla"):
    assert f"gather 1000x100 f32 zipf {backend} " in log, backend
  assert "backward 1000x100 f32 zipf sorted-scan" in log
  for case in ("sparse update, SGD", "sparse update, row-wise AdaGrad", "sparse update, LazyAdam",
               "sparse train step", "DLRM train step"):
    assert case in log, case
  # The targets' verdicts: the lookups' and each update's.
  assert "target gather mosaic:" in log and "target bag mosaic:" in log
  assert log.count("target sparse update") == 3
  assert "gpu_session: done" in log
  # Each script's --json record in $OUT, with its ratios.
  benchmark_scripts.read_record(tmp_path / "gpu_steps.json",
                                ["embedlib_vs_xla_ops_update_lazyadam", "update_share_of_copy_sgd"])
  benchmark_scripts.read_record(tmp_path / "gpu_lookup.json",
                                ["mosaic_vs_xla_gather_1000x100_f32_zipf"])


# The script's main with a wrong reference; reaching the timings exits 3.
WRONG_REFERENCE_RUN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("gpu_lookup", {script!r})
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
from embedlib import kernels
script.copy_bandwidth = lambda *args: sys.exit(3)
sys.exit(script.main(["--smoke", "--check"], references={{{which!r}: {wrong}}}))
"""
WRONG = {
    # The row after the right one.
    "gather": "lambda t, ids: kernels.gather_reference(t, ids + 1)",
    # Every bag summed, whatever its combiner: only "sum" bags agree.
    "bag": "lambda t, ids, w, combiner: kernels.bag_reference(t, ids, w, combiner='sum')",
}


# The bag case reruns the same check path with another kernel: -m slow.
@pytest.mark.parametrize("which", ["gather", pytest.param("bag", marks=pytest.mark.slow)])
def test_a_wrong_reference_fails_the_check_before_any_timing(which, env):
  code = WRONG_REFERENCE_RUN.format(script=str(SCRIPT), which=which, wrong=WRONG[which])
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
  # "check <backend> <lookup> ...": the lookup and its first qualifier.
  mismatches = [line.split()[2:4] for line in result.stdout.splitlines()
                if line.startswith("check ") and line.endswith("MISMATCH")]
  if which == "gather":
    assert mismatches and all(m[0] == "gather" for m in mismatches), mismatches
  else:
    assert mismatches and all(m[0] == "bag" and m[1] in ("mean", "sqrtn") for m in mismatches)


def test_gpu_session_measures_nothing_on_cpu(tmp_path, env):
  session = SCRIPT.parent / "gpu_session.sh"
  env = dict(env, PYTHON=sys.executable, OUT=str(tmp_path))
  result = subprocess.run(
      ["bash", str(session)], env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr
  assert "nothing measured" in result.stdout
  assert "nothing measured" in (tmp_path / "gpu_session.txt").read_text()
