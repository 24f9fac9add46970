"""The CPU kernels' library: built once per cache, and the XLA ops whenever it cannot be.

No compiler, a compiler that fails (its error is in the warning, and no
half-written library is left), the ``EMBEDLIB_CPU_KERNELS=0`` switch, and
two processes building into one empty cache at once (both load it).
"""

import logging
import os
import subprocess
import sys

from embedlib import kernels
from embedlib.kernels import cpu_library

from ..cpu_kernels import require_cpu_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_no_compiler_falls_back_with_a_warning(monkeypatch, caplog):
  monkeypatch.setattr(cpu_library, "compiler", lambda: None)
  with caplog.at_level(logging.WARNING, logger=cpu_library.__name__):
    assert cpu_library.library.__wrapped__() is None
  assert "no C++ compiler (set CXX, or install g++)" in caplog.text


def test_a_failing_build_falls_back_with_its_error(monkeypatch, tmp_path, caplog):
  cxx = tmp_path / "broken-c++"
  cxx.write_text("#!/bin/sh\necho 'fatal error: no space left' >&2\nexit 1\n")
  cxx.chmod(0o755)
  monkeypatch.setenv("CXX", str(cxx))
  monkeypatch.setenv("EMBEDLIB_CACHE_DIR", str(tmp_path / "cache"))
  with caplog.at_level(logging.WARNING, logger=cpu_library.__name__):
    assert cpu_library.library.__wrapped__() is None
  assert "fatal error: no space left" in caplog.text and "using XLA ops" in caplog.text
  assert os.listdir(tmp_path / "cache") == []  # no half-written library left behind


def test_switch_off_means_the_xla_gather(monkeypatch):
  require_cpu_kernels()
  assert cpu_library.available() and kernels.resolve_kernel("auto") == "cpu"
  monkeypatch.setenv(cpu_library.ENV_SWITCH, "0")
  assert not cpu_library.available() and kernels.resolve_kernel("auto") == "xla"


def test_two_processes_building_at_once_both_load_it(tmp_path):
  require_cpu_kernels()
  env = dict(os.environ, EMBEDLIB_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT)
  code = "from embedlib.kernels import cpu_library; assert cpu_library.library() is not None"
  procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE,
                            text=True) for _ in range(2)]
  for p in procs:
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
  built = os.listdir(tmp_path)
  assert len(built) == 1 and built[0].startswith("cpu_kernels-") and built[0].endswith(".so"), built
