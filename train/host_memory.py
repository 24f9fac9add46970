"""Keep freed host memory in the process, so XLA:CPU's step temporaries stop faulting in pages.

XLA's CPU runtime allocates every execution's temporaries afresh and frees
them after it. With glibc's default thresholds, blocks above a few MiB come
from ``mmap`` and go back with ``munmap`` (or the heap top is trimmed), so
each step faults in and zeroes its temporary pages again. Raising the mmap
and trim thresholds (``mallopt``; the same as the ``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` environment variables) keeps freed blocks for
the next step. On the 2-core development CPU the DLRM step of
``benchmarks/train_dlrm.py`` went from 79 to 62 ms. The cost: the process
keeps its peak heap instead of returning it to the system, which a training
process reaches again every step anyway.

Opt-in and experimental: ``python -m train --keep_freed_host_memory`` calls
`keep_freed_memory` at start-up, before jax is imported; elsewhere set the
environment variables before the process starts. Not the default, because of
one unexplained failure: set in a process that was already running XLA (the
test suite), it was followed by an abort (SIGABRT, no message) in the next
training run in 5 runs of 7. Set at start-up (the entrypoint, and the
benchmark workers through the environment) it has not failed here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (malloc.h) and the largest value an int carries.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LARGEST = 2**31 - 1


def keep_freed_memory() -> bool:
  """Raises glibc's mmap and trim thresholds to their largest; True if applied.

  A no-op returning False where there is no glibc ``mallopt`` (macOS,
  musl, Windows). Call it at start-up, before jax is imported (see the
  module docstring).
  """
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  mallopt.restype = ctypes.c_int
  return all(mallopt(p, _LARGEST) == 1 for p in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD))
