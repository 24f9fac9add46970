"""``train.host_memory``: glibc's thresholds are raised where there is a glibc.

Run in a subprocess: the setting lasts for the whole process, and this test
must not change the allocator under the rest of the suite.
"""

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
from train import host_memory
assert host_memory.keep_freed_memory() is True
assert host_memory.keep_freed_memory() is True
blocks = [bytearray(64 << 20) for _ in range(2)]  # memory still comes and goes
del blocks
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="mallopt is glibc's")
def test_keep_freed_memory_applies_on_glibc_and_is_idempotent():
  out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                       text=True, check=True)
  assert out.stdout.strip() == "ok"
