"""The CPU kernels' library: built once per cache, and the XLA ops whenever it cannot be.

No compiler, a compiler that fails (its error is in the warning, and no
half-written library is left), the ``EMBEDLIB_CPU_KERNELS=0`` switch, and
two processes building into one empty cache at once (both load it). A cache
another user could write is refused and the library built privately; an
empty or cut-short cached library is rebuilt; a library that lacks a handler
means the XLA ops. Each case is set up for real in a temporary directory.
The "compiler" of those cases copies the library this process already built
(``copying_compiler``), so that they check the cache, not the compiler; they
call ``_load``, which finds, builds and loads the library, because
``library()`` would then register its handlers, and XLA refuses a second
registration of a name at another address in the same process.
"""

import logging
import os
import pathlib
import shutil
import subprocess
import sys
import types

import pytest

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


@pytest.mark.slow
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


@pytest.fixture
def copying_compiler(tmp_path, monkeypatch):
  """A ``CXX`` that writes a copy of the real library to its ``-o`` path and logs that path.

  Returns:
    An object with ``cxx`` (its path), ``real_cxx`` (the compiler that built
    this process's library) and ``outputs()`` (the paths written so far).
  """
  require_cpu_kernels()
  real = cpu_library.library()._name
  log = tmp_path / "builds.log"
  cxx = tmp_path / "copying-c++"
  cxx.write_text(
      "#!/bin/sh\n"
      'while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
      f'echo "$out" >> {log}\n'
      f'cp {real} "$out"\n')
  cxx.chmod(0o755)
  real_cxx = cpu_library.compiler()
  monkeypatch.setenv("CXX", str(cxx))
  monkeypatch.delenv(cpu_library.ENV_SWITCH, raising=False)
  return types.SimpleNamespace(
      cxx=str(cxx), real_cxx=real_cxx,
      outputs=lambda: log.read_text().split() if log.exists() else [])


def _cache(tmp_path, monkeypatch, where="cache"):
  cache = tmp_path / where
  cache.mkdir(parents=True)
  cache.chmod(0o700)
  monkeypatch.setenv("EMBEDLIB_CACHE_DIR", str(cache))
  return cache


def _copy_of_the_library(cxx):
  planted = cpu_library.library_path(cxx)
  shutil.copy(cpu_library.library()._name, planted)
  planted.chmod(0o700)
  return planted


def _chown_or_skip(path, uid):
  try:
    os.chown(path, uid, -1, follow_symlinks=False)
  except PermissionError:
    pytest.skip("changing a file's owner needs root")


def _group_writable_dir(tmp_path, monkeypatch, cxx):
  _cache(tmp_path, monkeypatch).chmod(0o770)
  return "is writable by group (mode 0770)"


def _world_writable_sticky_dir(tmp_path, monkeypatch, cxx):
  _cache(tmp_path, monkeypatch).chmod(0o1777)   # sticky keeps others' files, not the cache, safe
  return "is writable by group and others (mode 1777)"


def _dir_of_another_user(tmp_path, monkeypatch, cxx):
  _chown_or_skip(_cache(tmp_path, monkeypatch), os.getuid() + 4242)
  return f"cache is owned by uid {os.getuid() + 4242}"


def _file_of_another_user(tmp_path, monkeypatch, cxx):
  _cache(tmp_path, monkeypatch)
  _chown_or_skip(_copy_of_the_library(cxx), os.getuid() + 4242)
  return f".so is owned by uid {os.getuid() + 4242}"


def _group_writable_file(tmp_path, monkeypatch, cxx):
  _cache(tmp_path, monkeypatch)
  _copy_of_the_library(cxx).chmod(0o760)
  return ".so is writable by group (mode 0760)"


def _link_to_elsewhere(tmp_path, monkeypatch, cxx):
  _cache(tmp_path, monkeypatch)
  elsewhere = tmp_path / "elsewhere.so"
  shutil.copy(cpu_library.library()._name, elsewhere)
  cpu_library.library_path(cxx).symlink_to(elsewhere)
  return ".so is not a regular file"


def _parent_writable_by_all(tmp_path, monkeypatch, cxx):
  cache = _cache(tmp_path, monkeypatch, where="shared/cache")
  cache.parent.chmod(0o777)   # anyone may rename the cache and put their own in its place
  return f"{cache.parent}, above {cache}, is writable by group and others without the sticky bit"


@pytest.mark.parametrize("make_unsafe", [
    _group_writable_dir, _world_writable_sticky_dir, _dir_of_another_user, _file_of_another_user,
    _group_writable_file, _link_to_elsewhere, _parent_writable_by_all,
])
def test_a_cache_another_user_could_write_is_refused(
    make_unsafe, copying_compiler, tmp_path, monkeypatch, caplog):
  why = make_unsafe(tmp_path, monkeypatch, copying_compiler.cxx)
  unsafe = pathlib.Path(os.environ["EMBEDLIB_CACHE_DIR"])
  before = {f: os.lstat(unsafe / f) for f in os.listdir(unsafe)}
  with caplog.at_level(logging.WARNING, logger=cpu_library.__name__):
    lib = cpu_library._load(copying_compiler.cxx)
  assert lib is not None and all(hasattr(lib, s) for s in cpu_library.TARGETS.values())
  warnings = [r.getMessage() for r in caplog.records]
  assert len(warnings) == 1 and "\n" not in warnings[0], warnings
  assert why in warnings[0] and "private temporary directory" in warnings[0], warnings[0]
  # Built and loaded elsewhere, the private directory gone once loaded, and
  # the refused cache neither written nor cleaned.
  (built,) = copying_compiler.outputs()
  private = os.path.dirname(built)
  assert not private.startswith(str(unsafe)) and os.path.dirname(lib._name) == private
  assert not os.path.exists(private)
  assert {f: os.lstat(unsafe / f) for f in os.listdir(unsafe)} == before


def test_a_world_writable_sticky_parent_is_accepted(copying_compiler, tmp_path, monkeypatch,
                                                    caplog):
  scratch = tmp_path / "scratch"
  scratch.mkdir()
  scratch.chmod(0o1777)   # like /tmp: no one may rename another user's entries
  monkeypatch.setenv("EMBEDLIB_CACHE_DIR", str(scratch / "embedlib"))
  with caplog.at_level(logging.WARNING, logger=cpu_library.__name__):
    lib = cpu_library._load(copying_compiler.cxx)
  assert lib is not None and caplog.records == []
  target = cpu_library.library_path(copying_compiler.cxx)
  (built,) = copying_compiler.outputs()
  assert os.path.dirname(built) == str(scratch / "embedlib") and lib._name == str(target)
  assert target.stat().st_mode & 0o777 == 0o700 and target.parent.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("keep", [0, 100, 5000, -800])
def test_an_empty_or_cut_short_library_is_rebuilt(keep, copying_compiler, tmp_path, monkeypatch,
                                                  caplog):
  # Cut at 5000 bytes, loading the library would kill the process (SIGBUS);
  # cut by 800 it loads, but lacks the section headers the linker wrote.
  _cache(tmp_path, monkeypatch)
  whole = pathlib.Path(cpu_library.library()._name).read_bytes()
  target = cpu_library.library_path(copying_compiler.cxx)
  target.write_bytes(whole[:keep])
  target.chmod(0o700)
  with caplog.at_level(logging.WARNING, logger=cpu_library.__name__):
    lib = cpu_library._load(copying_compiler.cxx)
  assert lib is not None and lib._name == str(target) and target.read_bytes() == whole
  (built,) = copying_compiler.outputs()
  assert os.path.dirname(built) == str(target.parent)   # a temporary name, then renamed
  (warning,) = [r.getMessage() for r in caplog.records]
  assert "rebuilding the CPU kernels" in warning and str(target) in warning


def test_a_library_without_the_handlers_means_the_xla_ops(copying_compiler, tmp_path, monkeypatch,
                                                          caplog):
  _cache(tmp_path, monkeypatch)
  target = cpu_library.library_path(copying_compiler.cxx)
  source = tmp_path / "other.cc"
  source.write_text('extern "C" int EmbedlibGather() { return 0; }\n')
  subprocess.run([copying_compiler.real_cxx, "-shared", "-fPIC", str(source), "-o", str(target)],
                 check=True)
  target.chmod(0o700)
  with caplog.at_level(logging.WARNING, logger=cpu_library.__name__):
    assert cpu_library.library.__wrapped__() is None
  (warning,) = [r.getMessage() for r in caplog.records]
  assert "does not define EmbedlibSgd, EmbedlibAdagrad" in warning and "using XLA ops" in warning
  # Loaded as found (no build), then removed so that the next process rebuilds it.
  assert copying_compiler.outputs() == [] and not target.exists()
