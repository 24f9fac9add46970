"""``train.host_memory``: glibc's thresholds are raised where there is a glibc."""

import platform
import sys

import pytest

from train import host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_keep_freed_memory_applies_on_glibc_and_is_idempotent():
  assert host_memory.keep_freed_memory() is True
  assert host_memory.keep_freed_memory() is True
  # Memory still comes and goes normally afterwards.
  blocks = [bytearray(64 << 20) for _ in range(2)]
  assert sum(len(b) for b in blocks) == 128 << 20
