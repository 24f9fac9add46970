"""The GPU benchmark script runs cleanly without a GPU and says it measured nothing."""

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
