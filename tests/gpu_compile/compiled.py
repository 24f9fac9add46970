"""Compiling a program for GPUs without one, and reading what the compiled program says.

`compile_checked` compiles through `embedlib.kernels.deviceless` and keeps
what the checks need: the optimized HLO, the memory analysis, the seconds it
took, and ptxas's report for each Mosaic GPU kernel. The checks:

- no register spills: XLA's own kernels (fusions, Triton) fail to compile
  if they spill (``xla_gpu_fail_ptx_compilation_on_register_spilling``);
  Mosaic GPU compiles its kernels itself, so its ptxas report (dumped
  with ``MOSAIC_GPU_DUMP_PTXAS``) is read, kernel by kernel. Mosaic GPU
  compiles a kernel once per process, so a program reports only the
  kernels no earlier program compiled; every report is checked
  (`PTXAS_REPORTS` keeps them all, for the session);
- collectives are asynchronous (`assert_async_collectives`);
- the right kernels are in the program and no CPU custom call is
  (`assert_gpu_custom_calls_only`);
- the memory analysis fits the target's HBM (`total_bytes`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
import re
import tempfile
import time

import jax

from embedlib.kernels import deviceless

#: Options for these compiles beside the deviceless ones. The suite's conftest
#: sets XLA's backend optimization level to 0 for its CPU programs; a GPU run
#: compiles at XLA's default (3), and spills depend on it. The autotuner is
#: off: with no device it times nothing, and the programs it leaves are level
#: 0's (the optimized HLO differs only in its empty annotations), after
#: compiling candidates it cannot choose between. The configs' models at
#: their documented sizes (`test_models`, ``-m slow``) compile at XLA's
#: default level.
CHECK_OPTIONS = {"xla_backend_optimization_level": 3,
                 "xla_gpu_fail_ptx_compilation_on_register_spilling": True,
                 "xla_gpu_autotune_level": 0}

#: Custom calls a GPU program may hold: Mosaic GPU and Triton kernels, cuBLAS.
GPU_CUSTOM_CALLS = {"mosaic_gpu_v2", "__gpu$xla.gpu.triton", "__cublas$gemm",
                    "__cublas$lt$matmul"}

# Collective opcodes of optimized GPU HLO (sync form; async ones add -start / -done).
_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter",
                "collective-permute", "ragged-all-to-all")
#: Every Mosaic GPU kernel compiled in this process -> ptxas's (spill stores, loads).
PTXAS_REPORTS: dict[str, tuple[int, int]] = {}
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? ([a-z][a-z0-9-]*)\((.*)$", re.M)


@dataclasses.dataclass
class Program:
  """A compiled program and what the checks read from it."""

  name: str
  text: str             # optimized, scheduled HLO
  memory: object        # CompiledMemoryStats
  seconds: float        # trace + lower + compile
  ptxas: dict           # kernels first compiled here -> (spill store bytes, spill load bytes)
  target: str
  xla_spills: bool = False   # an XLA kernel spilled (compiled again without failing on it)

  @property
  def mosaic_kernels(self) -> set[str]:
    """The Mosaic GPU kernels the program calls (``embedlib_gather_mosaic``, ...).

    Read from the custom calls' ``op_name``, which names the ``pallas_call``.
    """
    names = set()
    for line in self.text.splitlines():
      if 'custom_call_target="mosaic_gpu_v2"' in line:
        names.update(re.findall(r"/(embedlib_\w+?_mosaic)\b", line))
    return names


def compile_checked(name, fn, *args, mesh, target="H100", known_xla_spills=False,
                    options=None, **jit_kwargs) -> Program:
  """Compiles ``fn`` for ``mesh``'s GPUs with the checks' options; raises what XLA raises.

  ``known_xla_spills``: where XLA's own kernels of the program are known to
  spill, compile again without failing on it and say so (``xla_spills``),
  so that the program's other checks still run. ``options``: XLA options
  over `CHECK_OPTIONS`.
  """
  with tempfile.TemporaryDirectory() as dump:
    saved = {k: os.environ.get(k) for k in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS")}
    os.environ.update(MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTXAS="1")
    try:
      start = time.perf_counter()
      xla_spills = False
      try:
        compiled = deviceless.gpu_compile(fn, *args, mesh=mesh,
                                          compiler_options={**CHECK_OPTIONS, **(options or {})},
                                          **jit_kwargs)
      except jax.errors.JaxRuntimeError as e:
        if not (known_xla_spills and "register spilling" in str(e)):
          raise
        xla_spills = True
        compiled = deviceless.gpu_compile(
            fn, *args, mesh=mesh, **jit_kwargs, compiler_options={
                **CHECK_OPTIONS, **(options or {}),
                "xla_gpu_fail_ptx_compilation_on_register_spilling": False})
      seconds = time.perf_counter() - start
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
    ptxas = {p.stem: _spills(p.read_text()) for p in pathlib.Path(dump).glob("*.ptxas")}
  PTXAS_REPORTS.update(ptxas)
  return Program(name, compiled.as_text(), compiled.memory_analysis(), seconds, ptxas, target,
                 xla_spills)


def _spills(report: str) -> tuple[int, int]:
  stores = sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", report))
  loads = sum(int(b) for b in re.findall(r"(\d+) bytes spill loads", report))
  if "bytes spill stores" not in report:
    raise AssertionError(f"ptxas report without spill figures:\n{report}")
  return stores, loads


def assert_no_spills(program: Program) -> None:
  """Mosaic GPU kernels: ptxas reports no spills (XLA's kernels failed the compile if they did)."""
  spilled = {k: v for k, v in program.ptxas.items() if v != (0, 0)}
  assert not spilled, f"{program.name}: kernels spill registers (stores, loads): {spilled}"


def ops(text: str) -> collections.Counter:
  """Opcode counts of the optimized HLO, fused computations included."""
  return collections.Counter(m.group(1) for m in _OP.finditer(text))


def collectives(text: str) -> dict[str, str]:
  """Each collective kind in the program -> how it runs: ``async``, ``fused-async`` or ``sync``.

  ``fused-async``: inside a collective fusion started by ``fusion-start``.
  ``sync``: XLA's ConvertAsyncCollectivesToSync turned an async pair with
  nothing scheduled between start and done into the plain op; it marks the
  op ``"is_sync":true``. A plain collective without that mark was never
  made asynchronous and is reported as ``never-async``.
  """
  kinds = {}
  fused = set()
  for m in re.finditer(r"fusion-start\(.*?calls=%(\S+?),", text):
    fused.add(m.group(1))
  computation = None
  for line in text.splitlines():
    header = re.match(r"^(?:ENTRY )?%(\S+) ", line)
    if header and line.rstrip().endswith("{"):
      computation = header.group(1)
    m = _OP.match(line)
    if not m:
      continue
    op = m.group(1)
    for kind in _COLLECTIVES:
      if op in (f"{kind}-start", f"{kind}-done"):
        kinds[kind] = "async"
      elif op == kind:
        if computation in fused:
          how = "fused-async"
        elif '"is_sync":true' in line:
          how = "sync"
        else:
          how = "never-async"
        kinds.setdefault(kind, how)
        if how == "never-async":
          kinds[kind] = how
  return kinds


def assert_async_collectives(program: Program, expected=()) -> None:
  """Each ``expected`` kind is in the program, and every collective was made asynchronous."""
  found = collectives(program.text)
  for kind in expected:
    assert kind in found, f"{program.name}: no {kind} in the compiled program ({found})"
  never = [k for k, how in found.items() if how == "never-async"]
  assert not never, f"{program.name}: collectives XLA left synchronous: {never} ({found})"


def custom_calls(text: str) -> set[str]:
  return set(re.findall(r'custom_call_target="([^"]+)"', text))


def assert_gpu_custom_calls_only(program: Program, kernels=()) -> None:
  """``kernels`` (Mosaic GPU kernel names) were compiled; every custom call is a GPU one."""
  calls = custom_calls(program.text)
  assert calls <= GPU_CUSTOM_CALLS, f"{program.name}: non-GPU custom calls {calls - GPU_CUSTOM_CALLS}"
  missing = set(kernels) - program.mosaic_kernels
  assert not missing, f"{program.name}: kernels {missing} not compiled ({program.mosaic_kernels})"


def total_bytes(memory) -> int:
  """Per-device bytes the program holds at once: arguments, outputs not aliased to them, temporaries."""
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


def assert_fits(program: Program) -> None:
  """The program's buffers fit one target GPU's HBM."""
  hbm = deviceless.device_memory_bytes(program.target)
  assert total_bytes(program.memory) <= hbm, (
      f"{program.name}: {total_bytes(program.memory) / 2**30:.1f} GiB per device "
      f"> {hbm / 2**30:.1f} GiB of one {program.target}")


def abstract(state, mesh):
  """``ShapeDtypeStruct`` leaves of an ``nnx.eval_shape``-built state, each sharded as built.

  A leaf ``eval_shape`` leaves without a mesh sharding (a dense array, which
  ``setup._on_mesh`` places replicated in a concrete build) is replicated.
  """
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  def one(value):
    sharding = getattr(value, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      sharding = NamedSharding(mesh, P())
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

  return jax.tree.map(one, state)


def check_all(program: Program, *, kernels=(), collectives_=()) -> None:
  """Every check: kernels and GPU-only custom calls, no spills, async collectives."""
  assert_gpu_custom_calls_only(program, kernels)
  assert_no_spills(program)
  assert_async_collectives(program, collectives_)
