"""The GPU benchmark scripts run cleanly without a GPU and say they measured nothing."""

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_lookup.py"


@pytest.mark.parametrize("flags", [[], ["--check"]])
def test_gpu_lookup_measures_nothing_on_cpu(flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, str(SCRIPT), *flags], env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr
  assert "measures nothing" in result.stdout
  assert "GB/s" not in result.stdout  # no table was printed


def test_smoke_run_checks_and_times_every_case():
  # The whole script (checks, timed loops, table) at tiny sizes with the
  # kernels interpreted, so a GPU session does not spend its few device
  # minutes on a script error. The numbers mean nothing here.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, str(SCRIPT), "--smoke", "--check"],
      env=env, capture_output=True, text=True, timeout=600,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  checks = [l for l in result.stdout.splitlines() if l.startswith("check ")]
  assert len(checks) >= 28 and all(l.endswith(" ok") for l in checks), result.stdout
  for case in ("gather", "bag16", "bag64"):
    for op in ("xla", "pallas"):
      assert result.stdout.count(f" {op} ") >= 1, result.stdout
    assert sum(l.startswith(case + " ") for l in result.stdout.splitlines()) >= 8, case


def test_gpu_session_measures_nothing_on_cpu(tmp_path):
  session = SCRIPT.parent / "gpu_session.sh"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable, OUT=str(tmp_path))
  result = subprocess.run(
      ["bash", str(session)], env=env, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr
  assert "nothing measured" in result.stdout
  assert "nothing measured" in (tmp_path / "gpu_session.txt").read_text()
