"""What the many-rows-in-flight Triton kernels share: variants, column chunks, masked row loads.

The kernels of ``gather_rows``, ``bag_rows`` and ``segment_rows`` read
table (or gradient) rows by pointer in a ``[rows, columns]`` tile per
program: every row of the tile is requested before any is used, so a
program keeps ``rows x columns`` elements in flight, and Triton spreads the
tile over the program's warps with one 16-byte vector access per thread and
column group (a 128-float row is one warp's 32 x 16 bytes; a 64-wide bf16
row is 8 threads', four rows a warp). A small tile per program gives a grid
of thousands of programs, several resident per SM. No thread loops over
copies and no shared memory stages the rows: the loads go straight to
registers. `benchmarks/gpu_static.py` reads the load width, registers and
occupancy off the compiled PTX.

Triton tiles have power-of-two sides, so a row of ``features`` columns is
read as its binary decomposition (`column_chunks`: 100 = 64 + 32 + 4), each
chunk one tile whose columns are a contiguous range: the compiler then
proves the columns contiguous and aligned and emits vector accesses. Invalid
ids and ragged blocks are *masked* loads and stores (`load`, `store`: no
memory request for a masked lane), which Pallas's interpreter runs as well
when every index is an integer array, the form used here (a masked store's
lanes are pointed past the end of the ref, which the interpreter drops).

Each kernel's tile shape and warps are a *variant* (`GatherVariant`,
`BagVariant`, `SegmentVariant`), named for the sweep
(``benchmarks/gpu_sweep.py``) that times them and for
``kernels/gpu_choice.py``, which runs the fastest measured one.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

#: Prefix of every variant name of these kernels.
PREFIX = "triton-rows"


def pow2(n: int) -> int:
  """Smallest power of two >= ``n`` (and >= 1).

  >>> [pow2(n) for n in (1, 3, 64, 100)]
  [1, 4, 64, 128]
  """
  return 1 << max(int(n) - 1, 0).bit_length()


def column_chunks(features: int) -> tuple[tuple[int, int], ...]:
  """``(first column, width)`` of power-of-two chunks covering ``features`` columns, widest first.

  >>> column_chunks(128), column_chunks(100)
  (((0, 128),), ((0, 64), (64, 32), (96, 4)))
  """
  chunks, start = [], 0
  for bit in reversed(range(max(int(features), 0).bit_length())):
    width = 1 << bit
    if features & width:
      chunks.append((start, width))
      start += width
  return tuple(chunks)


def iota(n: int, start=0) -> jax.Array:
  """``start + arange(n)`` as int32 (Triton's ``make_range``: provably contiguous)."""
  return start + jnp.arange(n, dtype=jnp.int32)


def grid2(rows: jax.Array, cols: jax.Array):
  """``rows [r]`` and ``cols [c]`` broadcast to two ``[r, c]`` index arrays."""
  shape = (rows.shape[0], cols.shape[0])
  return (jnp.broadcast_to(rows[:, None], shape), jnp.broadcast_to(cols[None, :], shape))


def load(ref, rows, cols, mask, other=0):
  """``ref[rows[:, None], cols[None, :]]``, ``other`` where ``mask`` (``[r]``) is False.

  Masked lanes issue no memory request; their row index is not read.
  """
  r2, c2 = grid2(rows, cols)
  m2 = jnp.broadcast_to(mask[:, None], r2.shape)
  return pltriton.load(ref.at[r2, c2], mask=m2, other=other)


def store(ref, rows, cols, value, mask) -> None:
  """``ref[rows[:, None], cols[None, :]] = value`` where ``mask`` (``[r]``) is True.

  A masked lane's row is moved past the end of ``ref``: the GPU writes
  nothing there, and the interpreter, which writes every lane (the old value
  where masked), drops it, instead of letting it overwrite a lane that wrote
  the same row.
  """
  rows = jnp.where(mask, rows, ref.shape[0])
  r2, c2 = grid2(rows, cols)
  m2 = jnp.broadcast_to(mask[:, None], r2.shape)
  pltriton.store(ref.at[r2, c2], value.astype(ref.dtype), mask=m2)


def store_vector(ref, index, value, mask) -> None:
  """``ref[index] = value`` of a 1-D ref where ``mask`` is True (masked lanes as in `store`)."""
  index = jnp.where(mask, index, ref.shape[0])
  pltriton.store(ref.at[index], value.astype(ref.dtype), mask=mask)


def load_vector(ref, index, mask, other=0):
  """``ref[index]`` of a 1-D ref, ``other`` where ``mask`` is False."""
  return pltriton.load(ref.at[index], mask=mask, other=other)


def compiler_params(warps: int, stages: int = 1):
  """Triton compiler parameters (ignored in interpret mode)."""
  return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _parse(name: str, kind: str, fields: tuple[str, ...]) -> dict[str, int]:
  pattern = "-".join([re.escape(f"{PREFIX}-{kind}")] + [f"{f[0]}(\\d+)" for f in fields])
  m = re.fullmatch(pattern, name)
  if not m:
    example = "-".join([f"{PREFIX}-{kind}"] + [f"{f[0]}8" for f in fields])
    raise ValueError(f"variant {name!r} is not a {kind} variant name; the form is {example!r} "
                     f"({', '.join(fields)}).")
  return dict(zip(fields, map(int, m.groups())))


@dataclasses.dataclass(frozen=True)
class GatherVariant:
  """A gather program: ``rows`` ids (rows of the table) per program, on ``warps`` warps.

  >>> GatherVariant(64, 4).name, GatherVariant.parse("triton-rows-gather-r64-w4")
  ('triton-rows-gather-r64-w4', GatherVariant(rows=64, warps=4))
  """

  rows: int = 32
  warps: int = 4

  @property
  def name(self) -> str:
    return f"{PREFIX}-gather-r{self.rows}-w{self.warps}"

  @classmethod
  def parse(cls, name: str) -> "GatherVariant":
    return cls(**_parse(name, "gather", ("rows", "warps")))


@dataclasses.dataclass(frozen=True)
class BagVariant:
  """A bag program: ``bags`` bags per program, ``unroll`` slots of each read per step.

  A step requests ``bags x unroll`` rows (one tile) before summing them;
  both powers of two.

  >>> BagVariant(8, 4, 4).name
  'triton-rows-bag-b8-u4-w4'
  """

  bags: int = 8
  unroll: int = 4
  warps: int = 4

  @property
  def name(self) -> str:
    return f"{PREFIX}-bag-b{self.bags}-u{self.unroll}-w{self.warps}"

  @classmethod
  def parse(cls, name: str) -> "BagVariant":
    return cls(**_parse(name, "bag", ("bags", "unroll", "warps")))


@dataclasses.dataclass(frozen=True)
class SegmentVariant:
  """A segment-sum program: ``runs`` pieces of at most ``piece`` sorted positions each.

  Runs of equal ids longer than ``piece`` are cut into pieces (balanced
  programs whatever the id distribution), and a second kernel sums the
  pieces of each long run, ``unroll`` pieces a step.

  >>> SegmentVariant(16, 32, 4, 4).name
  'triton-rows-segment-p16-r32-u4-w4'
  """

  piece: int = 16
  runs: int = 32
  unroll: int = 4
  warps: int = 4

  @property
  def name(self) -> str:
    return f"{PREFIX}-segment-p{self.piece}-r{self.runs}-u{self.unroll}-w{self.warps}"

  @classmethod
  def parse(cls, name: str) -> "SegmentVariant":
    return cls(**_parse(name, "segment", ("piece", "runs", "unroll", "warps")))


def warps_for(rows: int, row_bytes: int) -> int:
  """Warps for a ``[rows, row_bytes]`` tile: each thread two 16-byte accesses or more, 1 to 8 warps.

  >>> warps_for(32, 512), warps_for(8, 128), warps_for(8, 64)
  (8, 1, 1)
  """
  return max(1, min(8, pow2(-(-rows * row_bytes // 1024))))


def default_variant(kind: str, row_bytes: int, count: int = 1 << 16, *, itemsize: int = 4):
  """The variant of ``kind`` (``gather`` / ``bag`` / ``segment``) for rows of ``row_bytes``.

  ``count``: the ids (gather, segment) or bags (bag) of a call: a bag
  program takes fewer bags when there are few, so that the grid still
  holds several programs per SM (132 SMs), and then reads more slots of
  each a step, so that the whole grid still keeps megabytes of rows in
  flight (HBM bandwidth times its latency: `ptx.Kernel.in_flight`).
  ``itemsize``: bytes of a gradient element (segment): two-byte rows take
  half the runs a program, since converting a 2-byte tile to the float32
  sums on eight warps spills (ptxas, sm_90a).

  >>> default_variant("bag", 512, count=4096), default_variant("bag", 512, count=1024)
  (BagVariant(bags=4, unroll=4, warps=8), BagVariant(bags=1, unroll=8, warps=4))
  >>> default_variant("segment", 256, itemsize=2)
  SegmentVariant(piece=16, runs=16, unroll=2, warps=4)
  """
  if kind == "gather":
    return GatherVariant(32, warps_for(32, row_bytes))
  if kind == "bag":
    programs = max(1, count // (4 * 132))      # at least 4 programs an SM
    bags = min(8, 1 << (programs.bit_length() - 1))
    unroll = min(16, max(4, pow2(-(-4096 // (bags * row_bytes)))))   # 4 KB a step or more
    return BagVariant(bags, unroll, warps_for(unroll * bags, row_bytes))
  if kind == "segment":
    runs = 32 if itemsize >= 4 else 16
    return SegmentVariant(16, runs, 2, warps_for(runs, row_bytes))
  raise ValueError(f"default_variant: kind={kind!r}; use 'gather', 'bag' or 'segment'.")


def parse_variant(name: str):
  """The variant object a ``triton-rows-...`` name stands for.

  >>> parse_variant("triton-rows-bag-b4-u8-w2")
  BagVariant(bags=4, unroll=8, warps=2)
  """
  for cls, kind in ((GatherVariant, "gather"), (BagVariant, "bag"), (SegmentVariant, "segment")):
    if name.startswith(f"{PREFIX}-{kind}-"):
      return cls.parse(name)
  raise ValueError(f"variant {name!r} names no {PREFIX} kernel; use a name like "
                   f"{GatherVariant().name!r}, {BagVariant().name!r} or {SegmentVariant().name!r}.")
