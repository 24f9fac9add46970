"""Handing freed host memory back to the system after a table-sized phase.

On CPU the devices' buffers are host memory from ``malloc``. glibc serves a
request from ``mmap`` only above a threshold that it raises to the size of
each mapped block freed (up to 32 MiB), so once a table shard has been freed,
shard-sized buffers (3 MiB at 100k rows x 64, 32 MB at 1M, on 8 devices) come
from its heaps, and freed ones stay resident there: a restore that replaces
every table, or a checkpoint whose writers encode every shard, left the
resident set higher by up to the tables' bytes for the rest of the run.
``malloc_trim`` returns those free pages. It runs after such phases only,
not per step: a fixed mmap threshold would do the same for every buffer but
map and fault in each step's temporaries afresh (measured slower per step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name) if name else None
  except OSError:
    return None
  if libc is None or not hasattr(libc, "gnu_get_libc_version"):
    return None  # macOS, musl: their allocators return memory in their own way
  return getattr(libc, "malloc_trim", None)


def release_freed() -> bool:
  """Returns the process's free ``malloc`` pages to the system (glibc only).

  >>> release_freed() in (True, False)
  True

  Returns:
    Whether glibc released any memory (False where there is no glibc).
  """
  trim = _malloc_trim()
  return bool(trim(0)) if trim is not None else False
