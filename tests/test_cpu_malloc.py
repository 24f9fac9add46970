"""``embedlib.cpu_malloc``: a step's freed temporaries are reused, not faulted in afresh.

The program here holds a 52 MB temporary (past glibc's largest dynamic mmap
threshold, 32 MiB), as DLRM's train step at the Criteo config's size does.
With glibc's defaults every run of it faults in the block's pages again;
after ``keep_freed_blocks`` a run reuses a block an earlier one freed.
Each case runs in a fresh process: the thresholds are the process's.
"""

import json
import os
import subprocess
import sys

import pytest

from embedlib import cpu_malloc
from embedlib.training import train_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, resource, sys
import jax, jax.numpy as jnp
from embedlib import cpu_malloc

kept = cpu_malloc.keep_freed_blocks()
f = jax.jit(lambda x: jnp.max(jnp.sin(x @ x.T), axis=0))   # a [3600, 3600] f32 product: 52 MB
x = jnp.ones((3600, 16), jnp.float32)
compiled = f.lower(x).compile()
temp = compiled.memory_analysis().temp_size_in_bytes
faults = []
for _ in range(12):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  jax.block_until_ready(compiled(x))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
json.dump({"kept": kept, "temp": temp, "faults": faults}, sys.stdout)
"""


def _run(**env_vars):
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "GLIBC_TUNABLES", cpu_malloc.ENV_SWITCH,
                      *cpu_malloc._USER_SETTINGS)}
  env.update(JAX_PLATFORMS="cpu", **env_vars)
  out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, check=True,
                       capture_output=True, text=True, timeout=300).stdout
  return json.loads(out.strip().splitlines()[-1])


def test_freed_blocks_are_reused_from_step_to_step():
  if cpu_malloc._left_alone({}) is not None:
    pytest.skip(f"not glibc: {cpu_malloc._left_alone({})}")
  kept, default = _run(), _run(**{cpu_malloc.ENV_SWITCH: "0"})
  assert kept["temp"] > 32 << 20   # the case this is for: past the dynamic threshold
  assert kept["kept"] and not default["kept"]
  pages = kept["temp"] // 4096
  # glibc's defaults: every run faults the block in again.
  assert min(default["faults"][1:]) > pages // 2, default
  # Kept: a run reuses a block an earlier one freed. Each of malloc's arenas
  # (one per thread that allocated it: the caller's and XLA's threads')
  # faults one in the first time, then keeps it; what faults in after that
  # is the product's own scratch, which XLA's kernels map themselves.
  assert sorted(kept["faults"][1:])[5] < pages // 4, kept
  assert sum(kept["faults"]) < sum(default["faults"]) / 2, (kept, default)


@pytest.mark.parametrize("environ, why", [
    ({cpu_malloc.ENV_SWITCH: "0"}, "EMBEDLIB_KEEP_FREED_BLOCKS=0"),
    ({cpu_malloc.ENV_SWITCH: "off"}, "EMBEDLIB_KEEP_FREED_BLOCKS=off"),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_ is set"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES sets a threshold"),
])
def test_settings_of_ones_own_are_left_alone(environ, why):
  assert cpu_malloc._left_alone(environ) == why
  assert cpu_malloc.keep_freed_blocks(environ) is False


def test_the_trainer_keeps_freed_blocks_before_it_builds_anything(monkeypatch, tmp_path):
  calls = []

  class Stop(Exception):
    pass

  def task(config):
    calls.append("task")
    raise Stop

  monkeypatch.setattr(train_lib.cpu_malloc, "keep_freed_blocks", lambda: calls.append("kept"))
  monkeypatch.setattr(train_lib.setup, "task", task)
  with pytest.raises(Stop):
    train_lib.train_and_evaluate(None, str(tmp_path))
  assert calls == ["kept", "task"]
