"""``benchmarks/lookup.py`` checks every case against ``jnp.take`` before timing it.

The quick run's checks pass and its three parts are timed, with both CPU
kernels and every strategy (the grid on the fsdp x tensor mesh), each sample
``--inner`` calls, and its
``--json`` record holds every case and the named ratios; a wrong
reference, or a case whose output is off in one element, fails the check,
and the script then exits 1 without timing. The
script runs in this process (the test suite's 8 CPU devices), so it uses
this checkout's embedlib. No time is asserted.
"""

import jax.numpy as jnp
import numpy as np

from embedlib import kernels, options
from tests import benchmark_scripts

from ..cpu_kernels import require_cpu_kernels


def load_script(monkeypatch):
  """The script, recording the cases of every ``interleaved`` (timing) call in
  ``.timed`` and the calls it times a sample in ``.calls``."""
  module = benchmark_scripts.load("lookup")
  module.timed, module.calls = [], []
  real = module.interleaved

  def recording(cases, repeats, **kwargs):
    module.timed.append(set(cases))
    module.calls.append(kwargs.get("calls", 1))
    return real(cases, repeats, **kwargs)

  monkeypatch.setattr(module, "interleaved", recording)
  return module


def test_quick_run_checks_then_times_both_kernels_and_every_strategy(monkeypatch, tmp_path):
  require_cpu_kernels()
  lookup = load_script(monkeypatch)
  path = tmp_path / "run.json"
  assert lookup.main(["--quick", "--repeats", "1", "--inner", "2", "--json", str(path)]) == 0
  assert lookup.calls == [2, 2, 2]
  record = benchmark_scripts.read_record(
      path, ["sharded_over_take", "vocab_over_replicated_8dev", "grid_over_replicated_fsdp_tensor"])
  assert len(record["cases"]) == sum(len(t) for t in lookup.timed)
  one_device, eight_devices, fsdp_by_tensor = lookup.timed
  assert one_device == {"jnp.take", "ShardedEmbed (one device, kernel 'cpu')",
                        "ShardedEmbed (one device, kernel 'xla')"}
  assert kernels.resolve_kernel("auto") == "cpu"
  assert {name.split(" ")[0] for name in eight_devices} == set(options.STRATEGIES) - {options.GRID}
  assert {name.split(" ")[0] for name in fsdp_by_tensor} == {
      options.REPLICATED, options.VOCAB, options.HIDDEN, options.GRID}


def test_a_wrong_reference_fails_the_run_before_any_timing(monkeypatch, capsys):
  lookup = load_script(monkeypatch)

  def next_row(table, ids):   # the row after the right one
    return np.take(table, (ids + 1) % table.shape[0], axis=0)

  assert lookup.main(["--quick", "--repeats", "1"], reference_fn=next_row) == 1
  assert lookup.timed == []
  assert "jnp.take differs from the reference" in capsys.readouterr().out


def test_one_element_off_fails_the_check():
  lookup = benchmark_scripts.load("lookup")
  table = jnp.arange(40.0).reshape(10, 4)
  ids = jnp.array([3, 3, 9, 0])
  right = lambda t, i: jnp.take(t, i, axis=0)

  def off(t, i):   # one element one float32 ulp away: a rounding-sized error
    rows = jnp.take(t, i, axis=0)
    return rows.at[2, 1].set(jnp.nextafter(rows[2, 1], jnp.inf))

  wants = {"right": (table, ids), "off": (table, ids)}
  assert lookup.agree({"right": (right, (table, ids))}, wants)
  assert not lookup.agree({"off": (off, (table, ids))}, wants)
