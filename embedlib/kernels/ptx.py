"""What a kernel's compiled code says, read without a GPU: load widths, registers, spills, occupancy.

`compiled_kernels` compiles a program for an H100 / H200 through
`deviceless` with XLA's PTX dump on (``xla_dump_emitter_re="ptx"`` writes
each kernel's PTX; the Triton kernels' too), then reads, for each kernel:

- the width of its global loads and stores, from the PTX's ``ld.global``
  and ``st.global`` instructions (``ld.global.v4.b32``: 16 bytes);
- its registers per thread, spills and static shared memory, from ``ptxas
  -v`` for ``sm_90a`` (the ptxas of the ``nvidia-cuda-nvcc`` wheel that the
  ``gpu-compile`` extra installs, or one on the PATH);
- its threads per block, grid and dynamic shared memory, from XLA's thunk
  sequence;

and `Kernel.occupancy` computes the theoretical occupancy from those and a
Hopper SM's limits (`SM`: the same on the H100 and the H200). No GPU runs:
this is what the code asks of the GPU, not how fast it goes.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import math
import pathlib
import re
import shutil
import subprocess
import tempfile

from embedlib.kernels import deviceless

#: A Hopper SM's limits (compute capability 9.0; CUDA occupancy calculator).
SM = dict(registers=65536, register_unit=256, warps=64, blocks=32, shared=228 * 1024,
          shared_reserved=1024, count=132)
#: HBM bandwidth by the vendors' datasheets, bytes per second.
HBM = {"H100": 3.35e12, "H200": 4.8e12}

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(")
_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)+)")
_THUNK = re.compile(r"kCustomKernel\s.*?\]\s+(\S+)\s+grid:\s*\[(\d+),\s*(\d+),\s*(\d+)\]\s+"
                    r"threads:\s*\[(\d+),\s*(\d+),\s*(\d+)\]\s+shared_memory:\s*(\d+)")


@dataclasses.dataclass
class Kernel:
  """One compiled kernel: what its PTX, ptxas and XLA's launch say."""

  name: str
  registers: int = 0
  spill_stores: int = 0
  spill_loads: int = 0
  static_shared: int = 0
  dynamic_shared: int = 0
  threads: int = 0
  grid: int = 0
  loads: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  stores: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  @property
  def load_bytes(self) -> int:
    """The widest global load, in bytes (16: ``ld.global.v4.b32``)."""
    return max(self.loads, default=0)

  @property
  def shared(self) -> int:
    return self.static_shared + self.dynamic_shared

  def blocks_per_sm(self) -> int:
    """Resident blocks per SM, the least of what registers, shared memory, warps and blocks allow."""
    warps = max(1, math.ceil(self.threads / 32))
    per_warp = math.ceil(max(self.registers, 1) * 32 / SM["register_unit"]) * SM["register_unit"]
    by_registers = (SM["registers"] // per_warp) // warps
    by_shared = SM["shared"] // (self.shared + SM["shared_reserved"])
    return min(by_registers, by_shared, SM["warps"] // warps, SM["blocks"])

  def occupancy(self) -> float:
    """Theoretical occupancy: resident warps over the SM's 64."""
    return self.blocks_per_sm() * max(1, math.ceil(self.threads / 32)) / SM["warps"]

  def load_bytes_per_thread(self) -> int:
    """Bytes of every global load in the code, per thread (a loop's body counted once: one step)."""
    return sum(width * count for width, count in self.loads.items())

  def in_flight(self) -> int:
    """Bytes the resident programs request at once, if each issues one step's loads before using them.

    To move ``B`` bytes a second at a memory latency of ``L`` seconds, ``B x
    L`` bytes must be in flight (Little's law): that, not occupancy alone,
    is what a gather of rows needs.
    """
    resident = min(self.grid, SM["count"] * self.blocks_per_sm())
    return self.load_bytes_per_thread() * self.threads * resident

  def waves(self) -> float:
    """Grid over what all SMs hold at once (below 1: some SMs idle)."""
    return self.grid / max(1, SM["count"] * self.blocks_per_sm())


def ptxas() -> str:
  """The ptxas to run: the ``nvidia-cuda-nvcc`` wheel's, else one on the PATH."""
  spec = importlib.util.find_spec("nvidia")
  for root in (spec.submodule_search_locations or []) if spec else []:
    path = pathlib.Path(root) / "cuda_nvcc" / "bin" / "ptxas"
    if path.exists():
      return str(path)
  found = shutil.which("ptxas")
  if found is None:
    raise FileNotFoundError("ptx: no ptxas; pip install -e '.[gpu-compile]' (nvidia-cuda-nvcc) "
                            "or put CUDA's bin folder on the PATH.")
  return found


def accesses(ptx: str) -> dict[str, tuple[collections.Counter, collections.Counter]]:
  """Per entry function: its global (loads, stores) as ``{bytes per access: count}``.

  >>> accesses('.entry k( ) { ld.global.nc.v4.b32 {a}, [p]; ld.global.b16 x, [q]; '
  ...          'st.global.v2.f32 [r], {b}; }')
  {'k': (Counter({16: 1, 2: 1}), Counter({8: 1}))}
  """
  out = {}
  entries = list(_ENTRY.finditer(ptx))
  for i, m in enumerate(entries):
    body = ptx[m.end():entries[i + 1].start() if i + 1 < len(entries) else len(ptx)]
    loads, stores = collections.Counter(), collections.Counter()
    for op, suffix in _ACCESS.findall(body):
      parts = suffix.split(".")
      lanes = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
      bits = next((int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p)), 8)
      (loads if op == "ld" else stores)[lanes * bits // 8] += 1
    out[m.group(1)] = (loads, stores)
  return out


def ptxas_report(ptx_path: str) -> dict[str, dict[str, int]]:
  """``ptxas -v -arch=sm_90a`` of a PTX file: registers, spills and static shared memory per entry."""
  result = subprocess.run([ptxas(), "-v", "-arch=sm_90a", ptx_path, "-o", "/dev/null"],
                          capture_output=True, text=True, check=True)
  report, name = {}, None
  for line in result.stderr.splitlines():
    m = re.search(r"Compiling entry function '(\w+)'", line)
    if m:
      name = m.group(1)
      report[name] = dict(registers=0, spill_stores=0, spill_loads=0, static_shared=0)
      continue
    if name is None:
      continue
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m:
      report[name].update(spill_stores=int(m.group(1)), spill_loads=int(m.group(2)))
    m = re.search(r"Used (\d+) registers", line)
    if m:
      report[name]["registers"] = int(m.group(1))
      s = re.search(r"(\d+) bytes smem", line)
      report[name]["static_shared"] = int(s.group(1)) if s else 0
  return report


def compiled_kernels(fn, *args, mesh, prefix: str = "embedlib_", compiler_options=None,
                     **jit_kwargs) -> dict[str, Kernel]:
  """Compiles ``fn`` for ``mesh``'s GPUs and reads every kernel whose name starts with ``prefix``.

  Args:
    fn, args, mesh, jit_kwargs: as for `deviceless.gpu_compile`.
    prefix: which kernels to read ("" for all, XLA's fusions too).
    compiler_options: XLA options beside the PTX dump's.

  Returns:
    Kernel name -> `Kernel`.
  """
  with tempfile.TemporaryDirectory() as dump:
    deviceless.gpu_compile(fn, *args, mesh=mesh, compiler_options={
        **(compiler_options or {}), "xla_dump_to": dump, "xla_dump_emitter_re": "ptx"},
        **jit_kwargs)
    kernels: dict[str, Kernel] = {}
    for path in sorted(pathlib.Path(dump).glob("*.ptx")):
      ptx_text = path.read_text()
      found = {k: v for k, v in accesses(ptx_text).items() if k.startswith(prefix)}
      if not found:
        continue
      report = ptxas_report(str(path))
      for name, (loads, stores) in found.items():
        kernels[name] = Kernel(name, loads=loads, stores=stores, **report.get(name, {}))
    for path in pathlib.Path(dump).glob("*thunk_sequence*"):
      for m in _THUNK.finditer(path.read_text()):
        kernel = kernels.get(m.group(1))
        if kernel is not None:
          kernel.grid = math.prod(int(g) for g in m.groups()[1:4])
          kernel.threads = math.prod(int(t) for t in m.groups()[4:7])
          kernel.dynamic_shared = int(m.group(8))
  return kernels


def roofline_us(moved_bytes: float, target: str) -> float:
  """Microseconds to move ``moved_bytes`` at ``target``'s HBM bandwidth (`HBM`).

  >>> round(roofline_us(3.35e6, "H100"), 3)
  1.0
  """
  return moved_bytes / HBM[target] * 1e6
