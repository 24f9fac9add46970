"""Host memory on CPU: freed blocks kept from step to step, handed back after a table-sized phase.

On CPU the devices' buffers are host memory from ``malloc``, and glibc's
thresholds decide what a freed block becomes.

**From step to step** (``keep_freed_blocks``). XLA:CPU allocates a program's
temporaries as one block each time it runs the program, and frees it after.
glibc serves a block above its mmap threshold (dynamic, at most 32 MiB)
with fresh pages from the kernel and hands them back when it is freed, so
every run pays a page fault and a zeroed page for each 4 KiB of the block.
DLRM's train step at the Criteo config's size (26 tables of 1M x 64) holds
about 49 MB of temporaries: thousands of page faults every step
(``benchmarks/README.md``, "DLRM training throughput", has the figures).
Raising the mmap and trim thresholds keeps freed blocks in the heap, where
the next step finds them. ``python -m train`` (``train_and_evaluate``)
calls it first thing; a loop of one's own may call it too. It leaves glibc
alone where the environment already sets these thresholds
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or
``GLIBC_TUNABLES``), where ``EMBEDLIB_KEEP_FREED_BLOCKS=0``, and where the
C library is not glibc.

**After a table-sized phase** (``release_freed``). Freed blocks stay
resident in the heap: a restore that replaces every table, or a checkpoint
whose writers encode every shard, would leave the resident set higher by up
to the tables' bytes for the rest of the run (glibc raises its dynamic
threshold to the size of each mapped block freed, so shard-sized buffers
come from its heaps even without ``keep_freed_blocks``). ``malloc_trim``
returns those free pages; it runs after such phases only, not per step,
whatever the thresholds (it ignores them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

from embedlib import options

_log = logging.getLogger(__name__)


#: Environment switch: "0" (or another of ``options.SWITCHED_OFF``) leaves glibc's thresholds alone.
ENV_SWITCH = "EMBEDLIB_KEEP_FREED_BLOCKS"
#: mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: The thresholds ``keep_freed_blocks`` sets: the largest glibc takes, as
#: ``MALLOC_*_THRESHOLD_`` would set them (``benchmarks/train_dlrm.py
#: --keep-freed-malloc``).
THRESHOLD = 2**31 - 1
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache
def _glibc():
  """glibc, or None (macOS, musl: their allocators return memory in their own way)."""
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name) if name else None
  except OSError:
    return None
  if libc is None or not hasattr(libc, "gnu_get_libc_version"):
    return None
  return libc


def _left_alone(environ) -> str | None:
  """Why ``keep_freed_blocks`` leaves the thresholds as they are, or None."""
  if options.switched_off(environ.get(ENV_SWITCH, "")):
    return f"{ENV_SWITCH}={environ[ENV_SWITCH]}"
  for name in _USER_SETTINGS:
    if name in environ:
      return f"{name} is set"
  tunables = environ.get("GLIBC_TUNABLES", "")
  if "mmap_threshold" in tunables or "trim_threshold" in tunables:
    return "GLIBC_TUNABLES sets a threshold"
  if _glibc() is None or not hasattr(_glibc(), "mallopt"):
    return "the C library is not glibc"
  return None


def keep_freed_blocks(environ=None) -> bool:
  """Raises glibc's mmap and trim thresholds for this process (module docstring).

  The cost: freed memory is kept for reuse instead of going back to the
  system, so the process stays at its peak (which a training process
  reaches at its first step anyway); ``release_freed`` still hands it back.

  Args:
    environ: the environment to read (default ``os.environ``).

  Returns:
    True if both thresholds were set; False if they were left as they are
    (the reason is logged at debug level).
  """
  why = _left_alone(os.environ if environ is None else environ)
  if why is None:
    libc = _glibc()
    if not (libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD)):
      why = "glibc refused the thresholds"
  if why is not None:
    _log.debug("embedlib: glibc's malloc thresholds left as they are: %s", why)
    return False
  return True


def release_freed() -> bool:
  """Returns the process's free ``malloc`` pages to the system (glibc only).

  >>> release_freed() in (True, False)
  True

  Returns:
    Whether glibc released any memory (False where there is no glibc).
  """
  libc = _glibc()
  trim = getattr(libc, "malloc_trim", None) if libc is not None else None
  return bool(trim(0)) if trim is not None else False
