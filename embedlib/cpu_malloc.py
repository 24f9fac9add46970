"""glibc's malloc told to keep freed blocks for the next train step.

Why: XLA:CPU allocates a program's temporaries as one block each time it
runs the program, and frees it after. glibc serves a block above its mmap
threshold (dynamic, at most 32 MiB) with fresh pages from the kernel and
hands them back when it is freed, so every run of the program pays a page
fault and a zeroed page for each 4 KiB of the block. DLRM's train step at
the Criteo config's size (26 tables of 1M x 64) holds 48.8 MB of
temporaries: thousands of page faults every step (``benchmarks/README.md``,
"DLRM training throughput", has the figures). Raising the mmap
and trim thresholds keeps freed blocks in the heap, where the next step
finds them: no faults after the first step.

The cost: memory freed is kept for reuse instead of going back to the
system, so the process stays at its peak (which a training process reaches
at its first step anyway). ``python -m train`` (``train_and_evaluate``)
calls ``keep_freed_blocks``; a loop of one's own may call it too. It leaves
glibc alone where the environment already sets these thresholds
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or
``GLIBC_TUNABLES``), where ``EMBEDLIB_KEEP_FREED_BLOCKS=0``, and where the
C library is not glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

_log = logging.getLogger(__name__)

#: Environment switch: "0" (or "false", "off", "no") leaves glibc's defaults.
ENV_SWITCH = "EMBEDLIB_KEEP_FREED_BLOCKS"
#: mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: The thresholds set: the largest glibc takes, as ``MALLOC_*_THRESHOLD_``
#: would set them (``benchmarks/train_dlrm.py --keep-freed-malloc``).
THRESHOLD = 2**31 - 1
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _left_alone(environ) -> str | None:
  """Why the thresholds are left as they are, or None."""
  if environ.get(ENV_SWITCH, "").strip().lower() in ("0", "false", "off", "no"):
    return f"{ENV_SWITCH}={environ[ENV_SWITCH]}"
  for name in _USER_SETTINGS:
    if name in environ:
      return f"{name} is set"
  tunables = environ.get("GLIBC_TUNABLES", "")
  if "mmap_threshold" in tunables or "trim_threshold" in tunables:
    return "GLIBC_TUNABLES sets a threshold"
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return "the C library is not glibc"
  return None


def keep_freed_blocks(environ=None) -> bool:
  """Raises glibc's mmap and trim thresholds for this process (module docstring).

  Args:
    environ: the environment to read (default ``os.environ``).

  Returns:
    True if both thresholds were set; False if they were left as they are
    (the reason is logged at debug level).
  """
  why = _left_alone(os.environ if environ is None else environ)
  if why is None:
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD)):
      why = "glibc refused the thresholds"
  if why is not None:
    _log.debug("embedlib: glibc's malloc thresholds left as they are: %s", why)
    return False
  return True
