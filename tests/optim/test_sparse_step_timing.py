"""The sparse-step benchmark (``benchmarks/sparse_step.py``): protocol and check.

Each case must run one untimed step right before each timed one, so that
what the previous case left behind (the dense step frees its temporaries
after its results are ready) is not charged to it. No time is measured here,
and a quick run must print every figure.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "sparse_step.py"


def load_script():
  """Imports the script by path; it extends ``sys.path`` itself, undone here."""
  saved = list(sys.path)
  try:
    spec = importlib.util.spec_from_file_location("sparse_step_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = saved
  return module


def test_every_timed_call_follows_an_untimed_call_of_the_same_case():
  sparse_step = load_script()
  calls = []

  def case(name):
    def run():
      calls.append(name)
      return float(len(calls))   # the call's position stands in for its ms
    return run

  times = sparse_step.settled_rounds({"a": case("a"), "b": case("b"), "c": case("c")}, 4)
  assert len(calls) == 3 * 4 * 2
  pairs = [calls[i:i + 2] for i in range(0, len(calls), 2)]
  assert all(first == second for first, second in pairs), pairs
  for name, recorded in times.items():
    # Only the second call of each pair is recorded: positions 2, 4, 6, ...
    assert len(recorded) == 4 and all(t % 2 == 0 for t in recorded), (name, recorded)
    assert all(calls[int(t) - 1] == name for t in recorded), (name, recorded)
  # Shuffled: the rounds do not all run in the same order.
  orders = [tuple(p[0] for p in pairs[r * 3:(r + 1) * 3]) for r in range(4)]
  assert len(set(orders)) > 1, orders


def test_quick_run_prints_every_figure_without_the_peers():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run(
      [sys.executable, str(SCRIPT), "--check", "--quick", "--no-peers", "--repeats", "1"],
      env=env, capture_output=True, text=True, timeout=600, check=True).stdout
  # On CPU: the check and a timed column for both updates (fused C++, XLA ops).
  assert "check (fused CPU update)" in out and "check (XLA ops)" in out, out
  assert out.count("agree with the dense reference") == 2, out
  assert out.count("sparse row-wise AdaGrad, XLA ops ") == 4, out  # 2 tables x (time, memory)
  assert out.count("speed-up (dense median / sparse median)") == 2, out
  assert out.count("step peak") == 6 and out.count("minor page faults per step") == 6, out
  assert "PyTorch" not in out  # --no-peers


def test_check_fails_on_a_reference_with_another_rule(capsys):
  # The check a GPU session runs first must be able to fail: a reference
  # with another epsilon moves every touched row.
  sparse_step = load_script()
  assert sparse_step.check(vocab=1000, width=8, n=512, steps=1)
  assert not sparse_step.check(vocab=1000, width=8, n=512, steps=1, eps=1e-2)
  assert "touched rows differ" in capsys.readouterr().out
