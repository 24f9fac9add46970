"""embedlib's CPU kernels: C++ XLA FFI handlers, compiled on first use.

``cpu/gather.cc`` (the row gather of ``gather_cpu.py``),
``cpu/bag.cc`` (the pooled bags of ``bag_cpu.py``),
``cpu/row_update.cc`` (the fused sparse updates of ``optim/fused_cpu.py``),
``cpu/unique.cc`` (the distinct ids of ``unique_cpu.py``, for dedup) and
``cpu/dynamic_map.cc`` (a dynamic table's map step, its lookup, and the
marking and placing of its rows, ``dynamic_map_cpu.py``).
On XLA:CPU a lookup or a row update visits rows scattered over a large
table; XLA's gather and scatter loops wait on each row's cache misses,
where these kernels fetch rows ahead and split the rows over XLA's
intra-op threads (``cpu/pool.h``). A table of 32 MiB or more that they meet
a second time is moved onto 2 MiB pages (``cpu/huge_pages.h``; off with
``EMBEDLIB_HUGE_PAGES=0``), so that a row costs no page-table walk.

The sources are compiled into one shared library the first time a kernel is
traced, with ``$CXX`` or the ``c++`` / ``g++`` / ``clang++`` on ``PATH``,
against jaxlib's FFI headers, and cached under ``$EMBEDLIB_CACHE_DIR``
(default ``$XDG_CACHE_HOME/embedlib``, i.e. ``~/.cache/embedlib``) by a hash
of the sources, jaxlib's version, the compiler and its flags (which name
the CPU's ISA level: ``isa_flags``).

Before a cached library is loaded, the cache must be this user's alone
(``cpu_cache.untrusted_dir`` / ``untrusted_file``: owner and mode of the
file, the directory and the directories above it). A cache that is not is
refused with a warning, and the library is built in a fresh private
temporary directory for this process instead, removed once loaded. An empty
or cut-short cached library is rebuilt; a build is written to a temporary
file and renamed into place. A loaded library must define every handler in
``TARGETS``. Without a compiler, if the build, the load or a check fails, or
with ``EMBEDLIB_CPU_KERNELS=0``, a warning is logged once (not for the
switch) and the XLA ops run instead, with the same results.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax

from embedlib import options
from embedlib import sharding as sharding_lib
from embedlib.kernels import cpu_cache

_log = logging.getLogger(__name__)
_SOURCE_DIR = pathlib.Path(__file__).with_name("cpu")
#: Environment switch: "0" (or another of ``options.SWITCHED_OFF``) keeps the XLA ops on CPU.
ENV_SWITCH = "EMBEDLIB_CPU_KERNELS"
#: FFI target name -> handler symbol in the library.
TARGETS = {
    "embedlib_gather": "EmbedlibGather",
    "embedlib_sgd": "EmbedlibSgd",
    "embedlib_adagrad": "EmbedlibAdagrad",
    "embedlib_adam_row": "EmbedlibAdamRow",
    "embedlib_adam_global": "EmbedlibAdamGlobal",
    "embedlib_unique": "EmbedlibUnique",
    "embedlib_dynamic_map_step": "EmbedlibDynamicMapStep",
    "embedlib_dynamic_map_step_place": "EmbedlibDynamicMapStepPlace",
    "embedlib_dynamic_map_lookup": "EmbedlibDynamicMapLookup",
    "embedlib_mark_placed": "EmbedlibMarkPlaced",
    "embedlib_set_rows": "EmbedlibSetRows",
    "embedlib_place_hashed_uniform": "EmbedlibPlaceHashedUniform",
    "embedlib_bag": "EmbedlibBag",
    "embedlib_interaction": "EmbedlibInteraction",
    "embedlib_interaction_backward": "EmbedlibInteractionBackward",
}
# -ffp-contract=off: the rules' arithmetic operation by operation, no fused
# multiply-adds (optim/rules.py). No -march=native: a cache directory may be
# shared by machines of different CPUs (the ISA level below is part of the
# library's name instead).
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off")
#: x86-64-v3's CPU flags as /proc/cpuinfo lists them (AVX2 and what comes
#: with it; "abm" is LZCNT).
_V3_CPU_FLAGS = frozenset(
    {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
  """The CPU's feature flags (the first ``flags`` line of ``cpuinfo``); empty if unknown."""
  try:
    with open(cpuinfo) as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.partition(":")[2].split())
  except OSError:
    pass
  return frozenset()


@functools.cache
def isa_flags(cxx: str) -> tuple[str, ...]:
  """``("-march=x86-64-v3",)`` where this CPU has AVX2 and ``cxx`` accepts it, else ``()``.

  The kernels' loops over a row's columns (sums, the rules) then run 8
  floats at a time instead of SSE's 4. The results are the same bits
  either way: every operation is element by element (no fused multiply-add,
  no reordered sum), so a vector instruction rounds each element as the
  scalar one does (``tests/kernels/test_cpu_isa.py``). The flags are part
  of the library's hash, so machines of different CPUs sharing a cache
  each build and load their own.
  """
  if platform.machine() not in ("x86_64", "AMD64") or not _V3_CPU_FLAGS <= _cpu_flags():
    return ()
  flag = "-march=x86-64-v3"
  # Preprocesses an empty input to stdout: the compiler checks the flag, and
  # writes no file.
  probe = subprocess.run([cxx, flag, "-x", "c++", "-E", "-"], input=b"", capture_output=True,
                         timeout=60)
  return (flag,) if probe.returncode == 0 else ()


def flags(cxx: str) -> tuple[str, ...]:
  """The compiler flags the library is built with (``_FLAGS`` and ``isa_flags``)."""
  return (*isa_flags(cxx), *_FLAGS)


def sources() -> list[pathlib.Path]:
  """The C++ sources and headers compiled into the library."""
  return sorted(_SOURCE_DIR.glob("*.cc")) + sorted(_SOURCE_DIR.glob("*.h"))


def compiler() -> str | None:
  """The C++ compiler to build with: ``$CXX``, else ``c++``, ``g++`` or ``clang++``; or None."""
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def library_path(cxx: str, directory: pathlib.Path | None = None) -> pathlib.Path:
  """The library's file for compiler ``cxx``: ``cpu_kernels-<hash>.so`` in ``directory``.

  Args:
    cxx: the compiler's path (`compiler`), part of the hash.
    directory: default ``cpu_cache.cache_dir()``.
  """
  import jaxlib  # noqa: PLC0415 (only here: its version keys the cache)

  key = hashlib.sha256(b"\0".join(
      [p.read_bytes() for p in sources()]
      + [jaxlib.__version__.encode(), cxx.encode(), " ".join(flags(cxx)).encode()]
  )).hexdigest()[:16]
  return (directory or cpu_cache.cache_dir()) / f"cpu_kernels-{key}.so"


def _build(cxx: str, target: pathlib.Path) -> None:
  """Compiles the library to ``target``: to a temporary name, then renamed.

  Concurrent builds (several processes starting at once) each rename a
  complete library; a failed one leaves nothing behind.
  """
  fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
  os.close(fd)
  cc = [str(p) for p in sources() if p.suffix == ".cc"]
  cmd = [cxx, *flags(cxx), "-I", jax.ffi.include_dir(), *cc, "-o", tmp]
  try:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
    cpu_cache.install(pathlib.Path(tmp), target)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _open(path: pathlib.Path) -> ctypes.CDLL:
  """Loads the library at ``path`` and checks that it defines every handler in ``TARGETS``."""
  lib = ctypes.CDLL(str(path))
  missing = [symbol for symbol in TARGETS.values() if not hasattr(lib, symbol)]
  if missing:
    # Built from these sources, it would define them all: the file is not
    # ours. Removed so that the next process builds a good one.
    path.unlink(missing_ok=True)
    raise RuntimeError(f"{path} does not define {', '.join(missing)}; removed it, so the "
                       "next process rebuilds it")
  return lib


def _open_private(cxx: str) -> ctypes.CDLL:
  """Builds the library in a fresh private directory, loads it and removes the directory.

  A loaded library stays mapped after its file is removed, and nothing is
  left for anyone to tamper with.
  """
  directory = pathlib.Path(os.path.realpath(tempfile.mkdtemp(prefix="embedlib-")))
  try:
    reason = cpu_cache.untrusted_dir(directory)
    if reason:
      raise RuntimeError(f"no private directory to build in: {reason}")
    target = library_path(cxx, directory)
    _build(cxx, target)
    return _open(target)
  finally:
    shutil.rmtree(directory, ignore_errors=True)


def _load(cxx: str) -> ctypes.CDLL:
  """The library, from the cache when it can be trusted, built there or privately if need be."""
  target = library_path(cxx)
  directory = pathlib.Path(os.path.realpath(target.parent))
  try:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    reason = cpu_cache.untrusted_dir(directory)
    target = directory / target.name
    if reason is None and os.path.lexists(target):
      reason = cpu_cache.untrusted_file(target)
  except OSError as e:
    reason = f"{directory} cannot be used ({e})"
  if reason:
    _log.warning(
        "embedlib: not loading the CPU kernels from the cache: %s. Building them in a private "
        "temporary directory for this process instead; to keep a cache, make %s yours and "
        "not writable by group or others, or set EMBEDLIB_CACHE_DIR to such a directory.",
        reason, directory)
    return _open_private(cxx)
  damaged = os.path.exists(target) and cpu_cache.incomplete(target)
  if damaged:
    _log.warning("embedlib: rebuilding the CPU kernels: %s.", damaged)
  if damaged or not os.path.exists(target):
    _build(cxx, target)
  return _open(target)


@functools.cache
def library() -> ctypes.CDLL | None:
  """Builds (once per cache), loads and registers the library; None if it cannot."""
  cxx = compiler()
  if cxx is None:
    _log.warning(
        "embedlib: no C++ compiler (set CXX, or install g++) for the CPU kernels; "
        "using XLA ops on CPU (slower lookups and sparse updates, same results)."
    )
    return None
  try:
    lib = _load(cxx)
    for name, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  except Exception as e:  # noqa: BLE001 (any failure here means the XLA ops, said once)
    _log.warning("embedlib: the CPU kernels are unavailable (%s); using XLA ops.", e)
    return None
  return lib


def switched_off() -> bool:
  """Whether ``EMBEDLIB_CPU_KERNELS`` turns the CPU kernels off."""
  return options.switched_off(os.environ.get(ENV_SWITCH, ""))


def available() -> bool:
  """Whether the CPU kernels may be used: not switched off, and the library loads."""
  return not switched_off() and library() is not None


def require() -> None:
  """Raises RuntimeError naming the fix when the library is not available."""
  if library() is None:
    raise RuntimeError(
        "embedlib: the CPU kernels' library could not be built or loaded (see the "
        "warning logged: install a C++ compiler or set CXX); use kernel='xla', or "
        "check cpu_library.available() first."
    )


def call(target: str, results, *operands, aliases=None, vary_like=None, **attrs):
  """``jax.ffi.ffi_call`` of a registered target, typed for ``shard_map``.

  Inside ``shard_map`` an FFI call's results are typed as invariant over
  the mesh; each is cast (a type change, no data moves) to vary over the
  axes XLA ops would give it: those of ``vary_like[i]`` when given (an
  input updated in place), else the union of the operands' axes.

  Args:
    target: a name in ``TARGETS``.
    results: ``jax.ShapeDtypeStruct`` per result.
    *operands: the handler's operands, in order.
    aliases: operand index -> result index, for results updated in place.
    vary_like: optional array (or None: the operands' union) per result, whose
      varying axes it takes.
    **attrs: the handler's attributes (numpy scalars).

  Returns:
    The list of results.
  """
  require()
  call_fn = jax.ffi.ffi_call(
      target, list(results), input_output_aliases=aliases, vmap_method="sequential")
  outs = call_fn(*operands, **attrs)
  union = frozenset().union(*(sharding_lib.varying_axes(x) for x in operands))
  cast = []
  for i, out in enumerate(outs):
    like = None if vary_like is None else vary_like[i]
    want = union if like is None else sharding_lib.varying_axes(like)
    missing = want - sharding_lib.varying_axes(out)
    cast.append(jax.lax.pcast(out, tuple(sorted(missing)), to="varying") if missing else out)
  return cast
