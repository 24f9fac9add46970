"""``benchmarks/wake_latency.py``: its C++ program builds, runs every round
both ways, and the run's record holds the ratios the README quotes. No time
is asserted."""

import pytest

from embedlib.kernels import cpu_library
from tests import benchmark_scripts


@pytest.mark.skipif(cpu_library.compiler() is None, reason="no C++ compiler")
def test_the_smoke_run_times_every_round_both_ways_and_records_the_ratios(tmp_path):
  script = benchmark_scripts.load("wake_latency")
  result = script.measure(100, rounds=3, sleep_us=100)
  assert result["busy_us"] == 100 and len(result["any_cpu_us"]) == 3
  assert len(result["start_any_us"]) == 3
  assert len(result["pinned_us"]) == (3 if result["cpus"] >= 2 else 0)
  assert all(t >= 0 for t in result["any_cpu_us"] + result["pinned_us"])
  out = tmp_path / "run.json"
  assert script.main(["--smoke", "--json", str(out)]) == 0
  ratios = ["late_share_200us"] + (["unpinned_over_pinned_200us"] if result["cpus"] >= 2 else [])
  benchmark_scripts.read_record(out, ratios)


def test_a_burst_of_no_rounds_is_refused():
  with pytest.raises(SystemExit):
    benchmark_scripts.load("wake_latency").main(["--rounds", "0"])
