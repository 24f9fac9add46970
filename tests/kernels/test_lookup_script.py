"""``benchmarks/lookup.py --quick`` runs whole and times both CPU kernels beside ``jnp.take``.

No time is asserted: the quick run must print the one-device table with the
default kernel (on CPU the C++ gather) and ``kernel="xla"``, and the
8-device table with every strategy.
"""

import os
import pathlib
import subprocess
import sys

from ..cpu_kernels import require_cpu_kernels

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "lookup.py"


def test_quick_run_prints_both_kernels_and_every_strategy():
  require_cpu_kernels()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, str(SCRIPT), "--quick"], env=env, capture_output=True,
                       text=True, timeout=300, check=True).stdout
  for case in ("jnp.take", "ShardedEmbed (one device, kernel 'cpu')",
               "ShardedEmbed (one device, kernel 'xla')", "replicated (", "vocab (", "hidden ("):
    assert case in out, (case, out)
