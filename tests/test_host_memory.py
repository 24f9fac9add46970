"""``embedlib.host_memory.keep_freed_blocks``: a step's freed temporaries are reused, not faulted in afresh.

XLA:CPU allocates a program's temporaries as one block per run; DLRM's
train step at the Criteo config's size holds 49 MB of them, past glibc's
largest dynamic mmap threshold (32 MiB). Here a 52 MB block is allocated,
written and freed six times with glibc's own malloc: with its defaults
every block is mapped afresh and each page faults in again; after
``keep_freed_blocks`` every block after the first is the one freed before.
(Through XLA the same holds per malloc arena, one per thread that allocates
the block, so the count of faults there depends on XLA's threads: the
benchmark measures it, ``benchmarks/README.md``.) Each case runs in a fresh
process: the thresholds are the process's.
"""

import json
import os
import subprocess
import sys

import pytest

from embedlib import host_memory
from embedlib.training import train_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import ctypes, json, resource, sys
from embedlib import host_memory

kept = host_memory.keep_freed_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 52_000_000   # a step's temporaries, as XLA:CPU allocates them: one block
faults = []
for _ in range(6):
  block = libc.malloc(size)
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  ctypes.memset(block, 1, size)   # the step writes its temporaries
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
  libc.free(block)
json.dump({"kept": kept, "size": size, "faults": faults}, sys.stdout)
"""


def _run(**env_vars):
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "GLIBC_TUNABLES", host_memory.ENV_SWITCH,
                      *host_memory._USER_SETTINGS)}
  env.update(JAX_PLATFORMS="cpu", **env_vars)
  out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, check=True,
                       capture_output=True, text=True, timeout=300).stdout
  return json.loads(out.strip().splitlines()[-1])


def test_freed_blocks_are_reused_from_step_to_step():
  if host_memory._left_alone({}) is not None:
    pytest.skip(f"not glibc: {host_memory._left_alone({})}")
  kept, default = _run(), _run(**{host_memory.ENV_SWITCH: "0"})
  assert kept["kept"] and not default["kept"]
  pages = kept["size"] // 4096
  # glibc's defaults: every block is mapped afresh, and faulted in again.
  assert min(default["faults"]) > pages // 2, default
  # Kept: the first block is faulted in, every later one is the block freed before.
  assert kept["faults"][0] > pages // 2 and max(kept["faults"][1:]) < 16, kept


@pytest.mark.parametrize("environ, why", [
    ({host_memory.ENV_SWITCH: "0"}, "EMBEDLIB_KEEP_FREED_BLOCKS=0"),
    ({host_memory.ENV_SWITCH: "off"}, "EMBEDLIB_KEEP_FREED_BLOCKS=off"),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_ is set"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES sets a threshold"),
])
def test_settings_of_ones_own_are_left_alone(environ, why):
  assert host_memory._left_alone(environ) == why
  assert host_memory.keep_freed_blocks(environ) is False


def test_the_trainer_keeps_freed_blocks_before_it_builds_anything(monkeypatch, tmp_path):
  calls = []

  class Stop(Exception):
    pass

  def task(config):
    calls.append("task")
    raise Stop

  monkeypatch.setattr(train_lib.host_memory, "keep_freed_blocks", lambda: calls.append("kept"))
  monkeypatch.setattr(train_lib.setup, "task", task)
  with pytest.raises(Stop):
    train_lib.train_and_evaluate(None, str(tmp_path))
  assert calls == ["kept", "task"]
