"""XLA:CPU's thread pool, sized for the simulated devices before jax starts its backend.

Why: on jax 0.10, XLA:CPU runs the programs of all simulated devices
(``--xla_force_host_platform_device_count=N``) on one pool of
``max(cores, N)`` threads (``tf_XLAEigen``), and a device waiting at a
collective holds its thread until every device has arrived. Its executor
orders a device's collectives only by when they start: a ``lax.cond`` or
``while`` whose branch holds a collective counts as started once entered,
and the branch's collective may be handed to the pool and run after the
next collective outside it, depending on which thread gets there first.
So one device can hold two threads at once (the branch's collective,
queued, and the next one), and different devices issue their collectives
in different orders. With one thread per device, the pool can then fill
with waiting devices while the work that would bring the missing device
to them waits in the pool's queue: a raw-id step (26 dynamic tables, each
a ``lax.cond`` of ``all_to_all`` s) stopped after a few steps, seven
devices in an all-gather and one in the all-to-all of a cond, every
``tf_XLAEigen`` thread blocked, until XLA aborted the process. The same run
finishes on jax 0.12 with XLA's own pool.
``tests/train/cpu_pool_deadlock.py`` is that stop reduced to the train step
alone, run with jax 0.10's pool and with this one (benchmarks/README.md
keeps its runs).

``configure`` sets ``PJRT_NPROC`` (which XLA reads once, when the CPU
client starts, ahead of the core count) to ``THREADS_PER_DEVICE`` threads a
device, so that a queued collective finds a thread: a device of the
raw-id step was seen holding two at once, and eight leave room for more
(a bound for these programs, not a proof for every program). ``import
embedlib`` calls it; it does nothing when the backend has started, when
``PJRT_NPROC`` is set already, or for a single device. Pure Python: it
reads the environment only, so importing it never starts jax.
"""

from __future__ import annotations

import os
import re
import sys

#: Environment variable XLA reads for the CPU client's thread count (before ``NPROC``).
ENV = "PJRT_NPROC"
#: Threads per simulated device: one for the device's program and room for
#: the collectives its conds and loops may leave queued behind it.
THREADS_PER_DEVICE = 8
#: XLA caps the pool that runs the devices' programs at this many threads.
MAX_THREADS = 256
#: The pool's threads, as Linux names them (``/proc/self/task/*/comm``).
THREAD_NAME = "tf_XLAEigen"

_DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def requested_devices(environ=None) -> int:
  """Simulated CPU devices the environment asks for (1 if none).

  >>> requested_devices({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  8
  >>> requested_devices({"JAX_NUM_CPU_DEVICES": "16"}), requested_devices({})
  (16, 1)
  """
  environ = os.environ if environ is None else environ
  found = _DEVICES_FLAG.findall(environ.get("XLA_FLAGS", ""))
  if found:
    return int(found[-1])  # XLA takes the last of repeated flags
  count = environ.get("JAX_NUM_CPU_DEVICES", "")
  return int(count) if count.strip().lstrip("-").isdigit() and int(count) > 0 else 1


def threads_for(devices: int, cores: int | None = None) -> int:
  """The pool size ``configure`` asks for: ``THREADS_PER_DEVICE`` a device, at least the cores.

  >>> threads_for(8, cores=2), threads_for(16, cores=2), threads_for(64, cores=2)
  (64, 128, 256)
  """
  cores = (os.cpu_count() or 1) if cores is None else cores
  return max(cores, min(MAX_THREADS, devices * THREADS_PER_DEVICE))


def backend_started() -> bool:
  """Whether jax has created a backend already (after which ``PJRT_NPROC`` is not read again)."""
  bridge = sys.modules.get("jax._src.xla_bridge")
  return bool(getattr(bridge, "_backends", None))


def configure(devices: int | None = None, environ=None) -> int | None:
  """Sets ``PJRT_NPROC`` for ``devices`` simulated devices, if it can still take effect.

  Args:
    devices: simulated CPU devices; None reads them from ``XLA_FLAGS`` (or
      ``JAX_NUM_CPU_DEVICES``).
    environ: the environment to change (default ``os.environ``).

  Returns:
    The thread count set, or None when nothing was set: one device, a
    ``PJRT_NPROC`` already there (the user's choice wins; ``check`` warns
    if it is too small), or a backend that has started.
  """
  environ = os.environ if environ is None else environ
  devices = requested_devices(environ) if devices is None else devices
  if devices <= 1 or ENV in environ or (environ is os.environ and backend_started()):
    return None
  threads = threads_for(devices)
  environ[ENV] = str(threads)
  return threads


def pool_threads() -> int | None:
  """Threads of XLA:CPU's device pool in this process (Linux), or None where unknown."""
  try:
    names = os.listdir("/proc/self/task")
  except OSError:
    return None
  count = 0
  for tid in names:
    try:
      with open(f"/proc/self/task/{tid}/comm") as f:
        count += f.read().strip() == THREAD_NAME
    except OSError:
      continue
  return count or None


def check(devices: int, threads: int | None = None) -> str | None:
  """A warning if XLA:CPU's pool is too small for ``devices``; None if it is fine or unknown.

  Args:
    devices: the CPU devices of the started backend.
    threads: the pool's threads (default: counted, ``pool_threads``).

  >>> check(8, threads=64) is None
  True
  >>> print(check(8, threads=8))
  XLA:CPU runs the 8 simulated devices on 8 threads: a step whose conds or loops hold collectives can stop with every thread waiting (see embedlib.cpu_pool). Set PJRT_NPROC=64 before jax starts (import embedlib first, or export it).
  """
  threads = pool_threads() if threads is None else threads
  need = min(MAX_THREADS, devices * THREADS_PER_DEVICE)
  if devices <= 1 or threads is None or threads >= need:
    return None
  return (f"XLA:CPU runs the {devices} simulated devices on {threads} threads: a step whose "
          "conds or loops hold collectives can stop with every thread waiting (see "
          f"embedlib.cpu_pool). Set {ENV}={need} before jax starts (import embedlib first, "
          "or export it).")
