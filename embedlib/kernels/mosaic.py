"""What the Mosaic GPU kernels share: which tables they take, row copies, the interpreter.

The kernels (`gather_mosaic`, `bag_mosaic`, `backward_mosaic`) move table
rows with the TMA engine: one asynchronous copy per row between global
memory and a block of shared memory, completed on an mbarrier, then one
copy of the block out (gather) or a warpgroup-wide sum in registers (bag,
backward). A copy addresses the table as ``[num_embeddings, features]``
by row and column, never by a flat element offset, so no offset exceeds
the row count (tables past 2**31 elements are fine). TMA needs each row to
be a whole number of 16-byte units and at most 256 elements per copied box,
so rows are copied in column chunks of at most 256; tables whose rows are
not 16-byte multiples (`supports`) take the XLA ops instead. A row too wide
for a program's rows to fit in one block's shared memory (`SMEM_LIMIT`) is
split by columns across programs (`program_columns`): each program moves
and sums its own columns, so the result is the same as one program's. An invalid id
copies a zero row (an operand of the kernel), so it reads zeros without
relying on out-of-bounds behaviour.

On a machine without a GPU the kernels run in Mosaic GPU's interpret mode
(jax >= 0.11: `interpret_params`), which simulates shared memory,
barriers and TMA copies, and can check for races.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

#: Widest box one TMA copy moves along a dimension.
MAX_BOX = 256
#: Lanes of a warpgroup: register rows are padded to a multiple.
LANES = 128
#: Grid axis name of the kernels.
BLOCKS = "blocks"
#: Shared-memory bytes a kernel's row buffer may take (several blocks share an SM).
SMEM_BYTES = 32 * 1024
#: Bytes a TMA copy's shared-memory address must be a multiple of (the GPU
#: faults with "misaligned address" otherwise; the interpreter does not check).
SMEM_ALIGN = 128
#: Shared memory one program may take: an H100's / H200's 227 KiB a block, less
#: room for the barriers and the buffers' alignment.
SMEM_LIMIT = 220 * 1024
#: Turned on by tests: the interpreter checks every access for races.
DETECT_RACES = False


def has_interpreter() -> bool:
  """Whether this jax can run Mosaic GPU kernels on the CPU (jax >= 0.11)."""
  return hasattr(plgpu, "InterpretGPUParams")


def copy_align() -> int:
  """Bytes every copy must be a multiple of: TMA's 16, or 128 on jax 0.10.

  jax 0.10's copies arrive on their barrier from each of the warpgroup's 128
  threads with an equal share of the bytes.
  """
  return 16 if has_interpreter() else 128


def supports(shape, dtype) -> bool:
  """Whether the Mosaic kernels take a ``[rows, features]`` table of ``dtype``.

  Rows must be whole copy units (`copy_align`), and the row count an int32.

  >>> supports((10, 128), jnp.float32), supports((10, 3), jnp.float32)
  (True, False)
  """
  rows, features = shape
  itemsize = jnp.dtype(dtype).itemsize
  return (features > 0 and (features * itemsize) % copy_align() == 0
          and rows < 2**31 and jnp.issubdtype(dtype, jnp.floating))


def interpret_params():
  """The Mosaic GPU interpreter's parameters (`DETECT_RACES`)."""
  _scope_barrier_check()
  return plgpu.InterpretGPUParams(detect_races=DETECT_RACES)


@functools.cache
def _scope_barrier_check():
  # jax 0.12's interpreter checks, when one device's kernel ends, that no
  # barrier of *any* device is still allocated; inside shard_map the other
  # devices' kernels are still running, and the check fails although each
  # kernel frees its own. The check is kept where it is right: one device.
  # Only the interpreter (CPU tests) reaches here; a jax without this
  # internal keeps its own check.
  try:
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    check = shared_memory.GPUSharedMemory.assert_no_barriers_allocated
  except (ImportError, AttributeError):
    return

  def one_device_only(self):
    if self.num_devices == 1:
      check(self)

  shared_memory.GPUSharedMemory.assert_no_barriers_allocated = one_device_only


def column_chunks(features: int) -> list[tuple[int, int]]:
  """``(start, width)`` of each TMA box along a row.

  >>> column_chunks(600)
  [(0, 256), (256, 256), (512, 88)]
  """
  return [(c, min(MAX_BOX, features - c)) for c in range(0, features, MAX_BOX)]


def lanes(features: int) -> int:
  """Register width of a row: ``features`` rounded up to a multiple of `LANES`."""
  return -(-features // LANES) * LANES


def row_floats(width: int) -> int:
  """Register floats of a row ``width`` wide: each column chunk padded to `LANES`."""
  return sum(lanes(w) for _, w in column_chunks(width))


def program_columns(features: int, dtype, smem_bytes) -> int:
  """Columns of a row one program takes: all of them, or the widest even split that fits.

  ``smem_bytes(columns)`` is a program's shared memory for rows ``columns``
  wide; the result is the largest divisor of ``features`` that is a whole
  number of copy units (`copy_align`) and keeps it within `SMEM_LIMIT`, so
  every program's copies have one shape. If none fits, the narrowest (one
  copy unit) is the answer: the rest of the program is then too large.

  >>> program_columns(512, jnp.float32, lambda w: 32 * 4 * w)
  512
  >>> program_columns(2048, jnp.float32, lambda w: 32 * 4 * w)
  1024
  """
  unit = max(copy_align() // jnp.dtype(dtype).itemsize, 1)
  if features % unit:
    return features   # not a table the kernels take (`supports`); nothing to split
  splits = [s for s in range(1, features // unit + 1)
            if features % s == 0 and (features // s) % unit == 0]
  for s in splits:
    if smem_bytes(features // s) <= SMEM_LIMIT:
      return features // s
  return features // splits[-1]


def block_and_column(columns: int, features: int):
  """This program's block of rows and the first of its ``columns`` (`program_columns`).

  Programs ``b * splits`` to ``b * splits + splits - 1`` take block ``b``'s
  column splits in order; with one split the column is a static 0.
  """
  splits = features // columns
  if splits == 1:
    return block_index(), 0
  p = block_index()
  return p // splits, (p % splits) * columns


def zero_row(width: int, row_dtype):
  """Float32 zeros of ``[width]`` in the register layout a row of ``row_dtype`` loads into.

  An accumulator carried through a loop must keep one layout; the loaded
  rows' layout is the strided one with the widest vector that divides the
  row (as Mosaic GPU picks it), not the splat layout of a constant.
  """
  bits = jnp.dtype(row_dtype).itemsize * 8
  vec = max(min(64 // bits, width // LANES), 1)
  while width % (vec * LANES):
    vec //= 2
  return plgpu.layout_cast(jnp.zeros((width,), jnp.float32),
                           plgpu.Layout.WG_STRIDED((width,), vec_size=vec))


def block_rows(n: int, row_bytes: int, *, most: int = MAX_BOX) -> int:
  """Rows per block: a power of two within `SMEM_BYTES`, at least 32.

  32 int32 ids are 128 bytes, a whole copy unit on every jax.
  """
  rows = 32
  while rows * 2 <= most and rows * 2 * row_bytes <= SMEM_BYTES and rows < n:
    rows *= 2
  return rows


def aligned(width: int, dtype) -> int:
  """``width`` rounded up so that a row of ``dtype`` is a whole number of `SMEM_ALIGN` bytes.

  >>> aligned(100, jnp.float32), aligned(128, jnp.float32), aligned(8, jnp.bfloat16)
  (128, 128, 64)
  """
  unit = max(SMEM_ALIGN // jnp.dtype(dtype).itemsize, 1)
  return -(-width // unit) * unit


def row_buffers(slots: int, features: int, dtype, *, pad: bool = False) -> list:
  """Shared-memory row buffers, one ``[slots, width]`` per column chunk.

  Chunk-major, so that each chunk of a block of rows is one box for a TMA
  copy when its rows are not padded. Every row starts on `SMEM_ALIGN` bytes
  (each width rounded up by `aligned`), since each row is a TMA copy's
  destination; with ``pad``, each width is rounded up to `LANES` instead
  (rows read into registers). The extra columns are never written and
  never stored.
  """
  return [plgpu.SMEM((slots, lanes(w) if pad else aligned(w, dtype)), dtype)
          for _, w in column_chunks(features)]


def flat_chunks(size: int) -> list[tuple[int, int]]:
  """``(start, size)`` of the TMA boxes that copy ``size`` contiguous elements."""
  return column_chunks(size)


def copy_flat(src_ref, start, dst_ref, barrier) -> None:
  """Starts the copy of ``src_ref[start:start + len(dst_ref)]`` into ``dst_ref``, box by box.

  Arrives on ``barrier`` once per box (``len(flat_chunks(len(dst_ref)))``).
  """
  for c0, size in flat_chunks(dst_ref.shape[0]):
    plgpu.copy_gmem_to_smem(src_ref.at[pl.ds(start + c0, size)], dst_ref.at[pl.ds(c0, size)],
                            barrier)


def copy_row(src_ref, row, dst_refs, slot, barrier, *, col0=0, columns: int | None = None) -> None:
  """Starts the copy of ``src_ref[row, col0:col0 + columns]`` into row ``slot`` of ``dst_refs``.

  ``dst_refs`` are the chunk buffers of `row_buffers` ``columns`` wide (by
  default the whole row). Arrives on ``barrier`` once per chunk
  (``len(column_chunks(columns))``).
  """
  columns = src_ref.shape[1] if columns is None else columns
  for (start, width), dst in zip(column_chunks(columns), dst_refs):
    if (dst.shape[1] * jnp.dtype(dst.dtype).itemsize) % SMEM_ALIGN:
      raise ValueError(f"a row buffer of {dst.shape[1]} {jnp.dtype(dst.dtype).name} columns puts "
                       f"its rows off the {SMEM_ALIGN}-byte alignment TMA copies need: make it "
                       "with `row_buffers`, which rounds the width up")
    plgpu.copy_gmem_to_smem(
        src_ref.at[pl.ds(row, 1), pl.ds(col0 + start, width)],
        dst.at[pl.ds(slot, 1), pl.ds(0, width)],
        barrier,
    )


def store_row(src_refs, slot, out_ref, row, columns: int, *, col0=0) -> None:
  """Starts the copy of row ``slot`` of ``src_refs`` into ``out_ref[row, col0:col0 + columns]``.

  The way back of `copy_row`: ``src_refs`` are the chunk buffers of
  `row_buffers` ``columns`` wide. A ``row`` past ``out_ref``'s end (a last
  block's padding) is skipped. Completes with ``plgpu.wait_smem_to_gmem``.
  """

  @pl.when(row < out_ref.shape[0])
  def _():
    for (start, width), buf in zip(column_chunks(columns), src_refs):
      plgpu.copy_smem_to_gmem(buf.at[pl.ds(slot, 1), pl.ds(0, width)],
                              out_ref.at[pl.ds(row, 1), pl.ds(col0 + start, width)])


def copy_valid_row(table_ref, zero_ref, row, valid, dst_refs, slot, barrier, *, col0=0) -> None:
  """`copy_row` of ``table_ref[row]``'s columns from ``col0`` if ``valid``, else of the zero row.

  The zero row (``[1, columns]``) is as wide as the columns one program takes.
  """

  @pl.when(valid)
  def _():
    copy_row(table_ref, row, dst_refs, slot, barrier, col0=col0, columns=zero_ref.shape[1])

  @pl.when(jnp.logical_not(valid))
  def _():
    copy_row(zero_ref, 0, dst_refs, slot, barrier)


def kernel(body, *, out_type, grid: int, scratch, interpret: bool):
  """``plgpu.kernel`` over a 1-D grid named `BLOCKS`, compiled or interpreted.

  The body's function name shows in the lowered module (tests look for it).
  """
  extra = {"interpret": interpret_params()} if interpret else {}
  return plgpu.kernel(
      body, out_type=out_type, grid=(grid,), grid_names=(BLOCKS,), scratch_types=scratch,
      **extra,
  )


def block_index():
  """This program's block (the grid index)."""
  return jax.lax.axis_index(BLOCKS)
