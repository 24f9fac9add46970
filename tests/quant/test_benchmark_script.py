"""benchmarks/quantized.py runs end to end on the quickstart's smoke config (slow: it trains)."""

import pytest

from tests import benchmark_scripts


@pytest.mark.slow
def test_quantized_benchmark_smoke(capsys, tmp_path):
  benchmark_scripts.load("quantized").main(["--smoke", "--json", str(tmp_path / "run.json")])
  lines = capsys.readouterr().out.splitlines()
  rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] and
          line.split()[0] in ("float32", "8", "4", "fp8", "bf16")}
  assert set(rows) == {"float32", "8", "4", "fp8", "bf16"}
  assert float(rows["8"][-1]) < 0.35 and float(rows["4"][-1]) < 0.2  # bytes vs float32
  record = benchmark_scripts.read_record(tmp_path / "run.json", ["8_bytes_over_float32"])
  assert record["ratios"]["8_bytes_over_float32"] == pytest.approx(float(rows["8"][-1]), abs=1e-3)
