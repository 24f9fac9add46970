"""The GPU benchmark scripts: their checks can fail, and without a GPU they measure nothing.

``gpu_session.sh --smoke --confirm --json FILE`` runs the whole session
(``gpu_sweep.py --smoke``: every kernel's variants, the backward, the
updates and both steps, then the lookups' confirming rerun) at tiny sizes
with the kernels interpreted, so that a GPU session does not spend its
device time on a script error: every check must pass, and every case be
timed and written in the run's record (``timing.Run``) with the keys
``gpu_table.py`` reads (exit 0). ``gpu_sweep.py --smoke`` on the gather
alone is the fast test of the same keys. The scripts the session ran before
(``gpu_lookup.py``, ``gpu_steps.py``) still check and write their records
(slow). With a wrong gather or bag reference ``gpu_lookup.py``'s check must
fail and the script exit 1 before timing anything (slow too). The runs share a
compilation cache. Every run uses this checkout's embedlib. No time is
asserted."""

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


# CI runs the session's sweep; the scripts it ran before are -m slow.
@pytest.mark.parametrize("script,flags", [
    pytest.param("gpu_lookup.py", [], marks=pytest.mark.slow),
    pytest.param("gpu_lookup.py", ["--check"], marks=pytest.mark.slow),
    pytest.param("gpu_steps.py", ["--check"], marks=pytest.mark.slow), ("gpu_sweep.py", [])])
def test_gpu_scripts_measure_nothing_on_cpu(script, flags, env):
  result = subprocess.run(
      [sys.executable, str(SCRIPT.parent / script), *flags], env=env, capture_output=True,
      text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "measures nothing" in result.stdout
  assert "GB/s" not in result.stdout  # no table was printed


#: The keys of every case of a sweep's results (``gpu_table.py`` reads them).
KEYS = {"kernel", "variant", "shape", "dtype", "ids", "median_us"}


def assert_cases(cases, kernels):
  for c in cases:
    assert KEYS <= set(c), c
    assert c["check"] is True and c["median_us"] > 0, c
  assert {c["kernel"] for c in cases} == set(kernels)


def test_smoke_sweep_of_the_gather_writes_every_key(tmp_path, env):
  out = tmp_path / "sweep.json"
  result = subprocess.run(
      [sys.executable, str(SCRIPT.parent / "gpu_sweep.py"), "--smoke", "--kernels", "gather",
       "--no-steps", "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
  cases = benchmark_scripts.read_record(out, ["share_of_copy_gather_300x64_float32_zipf",
                                              "rows_vs_xla_gather_300x64_int8_zipf"])["cases"]
  assert_cases(cases, ["copy", "gather"])
  variants = {c["variant"] for c in cases}
  assert "xla" in variants and "triton-tile" in variants
  assert any(v.startswith("triton-rows-gather-") for v in variants)
  assert {c["dtype"] for c in cases} == {"float32", "int8"}


@pytest.mark.slow
def test_smoke_session_passes_its_checks_and_times_every_case(tmp_path, env):
  session = SCRIPT.parent / "gpu_session.sh"
  env = dict(env, PYTHON=sys.executable, OUT=str(tmp_path))
  out = tmp_path / "sweep.json"
  result = subprocess.run(["bash", str(session), "--smoke", "--confirm", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=3000)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
  log = (tmp_path / "gpu_session.txt").read_text()
  assert "DIFFER" not in log and "gpu_session: done" in log
  cases = benchmark_scripts.read_record(out, ["auto_vs_xla_step-sparse",
                                              "rows_vs_xla_gather_300x64_float32_zipf",
                                              "share_of_copy_update-adam_300x64_float32_zipf"]
                                        )["cases"]
  assert_cases(cases, ["copy", "gather", "bag16", "bag64", "backward", "update-sgd",
                       "update-adagrad", "update-adam", "step-sparse", "step-dlrm"])
  variants = {c["variant"] for c in cases}
  for family in ("xla", "xla-slots", "xla-sorted", "xla-ops", "triton-tile", "auto",
                 "triton-rows-gather-", "triton-rows-bag-", "triton-rows-segment-"):
    assert any(v.startswith(family) for v in variants), family
  # The table a GPU run's file would give: one choice per measured lookup.
  from embedlib.kernels import gpu_choice
  assert {c.kind for c in gpu_choice.table_from_results(cases)} == {
      "gather", "bag", "backward", "update-sgd", "update-adagrad", "update-adam"}
  # --confirm: the lookups swept once more, into the file gpu_table.py reads beside the first.
  again = benchmark_scripts.read_record(tmp_path / "sweep_confirm.json")["cases"]
  assert_cases(again, ["copy", "gather", "bag16", "bag64", "backward", "update-sgd",
                       "update-adagrad", "update-adam"])


@pytest.mark.slow
@pytest.mark.parametrize("script,ratios", [
    ("gpu_steps", ["embedlib_vs_xla_ops_update_lazyadam", "update_share_of_copy_sgd"]),
    ("gpu_lookup", ["mosaic_vs_xla_gather_1000x100_f32_zipf"])])
def test_the_scripts_the_session_ran_before_the_sweep_still_check_and_record(script, ratios,
                                                                            tmp_path, env):
  out = tmp_path / f"{script}.json"
  result = subprocess.run([sys.executable, str(SCRIPT.parent / f"{script}.py"), "--smoke",
                           "--check", "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=1800)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
  assert "MISMATCH" not in result.stdout and "DIFFERS" not in result.stdout
  benchmark_scripts.read_record(out, ratios)


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


# gpu_lookup.py --check interprets every kernel of every backend (the GPU
# session now runs gpu_sweep.py): both cases are -m slow, as are its other runs.
@pytest.mark.slow
@pytest.mark.parametrize("which", ["gather", "bag"])
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
