"""Large tables on 2 MiB pages (``embedlib/kernels/cpu/huge_pages.h``).

The CPU kernels ask Linux to back a table of 32 MiB or more with
transparent huge pages the second time they see it: a donated table that a
fused update writes in place, a parameter that a lookup reads call after
call. The pages are read back from ``/proc/self/smaps`` (AnonHugePages of
the mappings over the buffer). A table seen once, one below the size, or
any table with ``EMBEDLIB_HUGE_PAGES=0`` keeps malloc's 4 KiB pages; those
checks need THP's "madvise" mode, where nothing else makes huge pages, and
run in a fresh process, whose heap holds none yet. The
values are the same either way, bit for bit.

Skipped where the kernel cannot collapse pages (no THP, or Linux before
6.1): a probe mapping is collapsed first, by the same two calls.
"""

import ctypes
import functools
import json
import mmap
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embedlib.kernels import gather_cpu
from embedlib.optim import fused_cpu, rules

from .. import benchmark_scripts
from ..cpu_kernels import require_cpu_kernels

MiB = 1 << 20
HUGE = 2 * MiB
MADV_COLLAPSE = 25  # linux/mman.h; not in Python's mmap module
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
WIDTH = 64
LR = 0.5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# AnonHugePages of the mappings over a range, as the benchmark reads them.
huge_bytes = benchmark_scripts.load("huge_pages").huge_page_bytes


def thp_mode():
  try:
    with open(THP_MODE) as f:
      return re.search(r"\[(\w+)\]", f.read())[1]
  except OSError:
    return None


@functools.cache
def collapse_works():
  """Whether MADV_HUGEPAGE then MADV_COLLAPSE give a probe mapping a huge page."""
  if thp_mode() in (None, "never"):
    return False
  m = mmap.mmap(-1, 2 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  view = ctypes.c_char.from_buffer(m)
  try:
    base = ctypes.addressof(view)
    off = -base % HUGE
    m[off:off + HUGE] = b"\1" * HUGE
    m.madvise(mmap.MADV_HUGEPAGE, off, HUGE)
    m.madvise(MADV_COLLAPSE, off, HUGE)
    return huge_bytes(base + off, HUGE) >= HUGE
  except OSError:
    return False
  finally:
    del view
    m.close()


@pytest.fixture(autouse=True)
def needs_collapse():
  require_cpu_kernels()
  if not collapse_works():
    pytest.skip(f"this kernel cannot collapse pages into huge ones (THP: {thp_mode()})")


def madvise_mode_only():
  if thp_mode() != "madvise":
    pytest.skip(f"THP is {thp_mode()!r}: malloc's pages may be huge without the kernels")


def interior(x):
  """The 2 MiB pages inside ``x``'s buffer: (address, bytes)."""
  start = x.unsafe_buffer_pointer()
  begin = -(-start // HUGE) * HUGE
  return begin, (start + x.nbytes) // HUGE * HUGE - begin


def table_of(mib):
  rows = mib * MiB // (4 * WIDTH)
  return jnp.arange(rows * WIDTH, dtype=jnp.float32).reshape(rows, WIDTH) * 2.0**-20


GATHER = jax.jit(gather_cpu.gather_cpu)
IDS = jnp.asarray([5, 0, 77_777, 3, 123_456], jnp.int32)


def test_a_donated_table_updated_in_place_moves_to_huge_pages():
  table = table_of(40)
  want = np.asarray(table).copy()
  grads = jnp.ones((IDS.shape[0], WIDTH), jnp.float32)
  want[np.asarray(IDS)] += np.float32(-LR) * np.float32(1.0)
  want[np.asarray(IDS)] += np.float32(-LR) * np.float32(1.0)
  step = jax.jit(lambda t: fused_cpu.update(rules.SparseSGD(LR), t, {}, IDS, grads, LR, 0,
                                            first_row=0, first_col=0, features=WIDTH)[0],
                 donate_argnums=0)
  before = table.unsafe_buffer_pointer()
  table = step(step(table))
  assert table.unsafe_buffer_pointer() == before  # in place: the same buffer both times
  begin, nbytes = interior(table)
  assert huge_bytes(begin, nbytes) >= nbytes // 2, "the donated table kept 4 KiB pages"
  np.testing.assert_array_equal(np.asarray(table), want)


def test_a_table_looked_up_twice_moves_to_huge_pages_with_its_values():
  table = table_of(36)
  want = np.asarray(table)[np.asarray(IDS)]
  for _ in range(2):
    np.testing.assert_array_equal(np.asarray(GATHER(table, IDS)), want)
  begin, nbytes = interior(table)
  assert huge_bytes(begin, nbytes) >= nbytes // 2, "the looked-up table kept 4 KiB pages"
  np.testing.assert_array_equal(np.asarray(table), np.asarray(table_of(36)))


# In a process of its own: a process whose heap already holds huge pages
# (freed tables that were moved there, kept by glibc under
# host_memory.keep_freed_blocks' thresholds, as the trainer's tests set
# them) may hand a new table memory that is on huge pages from the start.
OTHER_TABLES = """
import json, os
from tests.kernels import test_huge_pages as t
out = {}
for case, mib, calls in (("seen once", 44, 1), ("below 32 MiB", 24, 3), ("switched off", 48, 3)):
  if case == "switched off":
    os.environ["EMBEDLIB_HUGE_PAGES"] = " Off"
  table = t.table_of(mib)
  for _ in range(calls):
    t.GATHER(table, t.IDS).block_until_ready()
  out[case] = t.huge_bytes(*t.interior(table))
print(json.dumps(out))
"""


def test_other_tables_keep_mallocs_pages():
  madvise_mode_only()
  env = {k: v for k, v in os.environ.items()
         if k not in ("EMBEDLIB_HUGE_PAGES", "GLIBC_TUNABLES", "XLA_FLAGS")}
  out = subprocess.run([sys.executable, "-c", OTHER_TABLES], cwd=ROOT, env=env, check=True,
                       capture_output=True, text=True, timeout=300).stdout
  huge = json.loads(out.strip().splitlines()[-1])
  assert huge == {"seen once": 0, "below 32 MiB": 0, "switched off": 0}
