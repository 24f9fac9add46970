"""Mosaic GPU row gather: ``rows[i] = table[ids[i]]``, zero rows for invalid ids.

Each program takes a block of ids: it copies the block of ids into shared
memory, starts one TMA copy per id of that id's row (the zero row for an
invalid id) into a ``[block, features]`` buffer, waits for all of them on
one barrier, and writes the buffer to its rows of the output with one TMA
copy. No register touches the rows: the copy engine moves every byte, and
a block's copies are all in flight at once. The last block's rows past the
end of the output are clipped by the copy out (TMA drops out-of-bounds
writes); its ids past the end are padding (-1) added outside the kernel.
Rows that are not a whole number of `mosaic.SMEM_ALIGN` bytes sit in a
buffer of padded rows (each row copy's destination must be aligned), and
are written out one row at a time, the padding left behind.
Rows too wide for a block of them in shared memory are split by columns
(`mosaic.program_columns`): each program then copies its block's rows'
columns ``[col0, col0 + columns)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from embedlib.kernels import mosaic
from embedlib.sharding import match_varying, out_struct


def gather_mosaic(table: jax.Array, ids: jax.Array, *, interpret: bool = False) -> jax.Array:
  """Row gather as a Mosaic GPU kernel (`mosaic.supports` tables only).

  Equivalent JAX code (`embedlib.kernels.gather_reference`)::

    valid = (ids >= 0) & (ids < table.shape[0])
    rows = jnp.where(valid[..., None], jnp.take(table, jnp.where(valid, ids, 0), axis=0), 0)

  Not differentiable by itself: `embedlib.kernels.gather` wraps it.

  Args:
    table: ``[num_embeddings, features]``; rows a multiple of 16 bytes.
    ids: int array of any shape.
    interpret: run in Mosaic GPU's interpreter (CPU, jax >= 0.11).

  Returns:
    ``ids.shape + (features,)`` in ``table.dtype``.
  """
  num_embeddings, features = table.shape
  flat = ids.reshape(-1)
  n = flat.shape[0]
  if n == 0 or num_embeddings == 0:
    return jnp.zeros(ids.shape + (features,), table.dtype)
  flat = jnp.where((flat >= 0) & (flat < num_embeddings), flat, -1).astype(jnp.int32)
  itemsize = table.dtype.itemsize
  columns = mosaic.program_columns(
      features, table.dtype,
      lambda w: mosaic.block_rows(n, w * itemsize) * (4 + itemsize * sum(
          mosaic.aligned(c, table.dtype) for _, c in mosaic.column_chunks(w))))
  block = mosaic.block_rows(n, columns * itemsize)
  grid = pl.cdiv(n, block)
  flat = jnp.pad(flat, (0, grid * block - n), constant_values=-1)
  zero = jnp.zeros((1, columns), table.dtype)
  flat, table, zero = match_varying(flat, table, zero)
  chunks = mosaic.column_chunks(columns)

  def embedlib_gather_mosaic(ids_ref, table_ref, zero_ref, out_ref, ids_smem, *rest):
    *rows, ids_barrier, rows_barrier = rest
    b, col0 = mosaic.block_and_column(columns, features)
    start = b * block
    plgpu.copy_gmem_to_smem(ids_ref.at[pl.ds(start, block)], ids_smem, ids_barrier)
    plgpu.barrier_wait(ids_barrier)

    def issue(k, carry):
      row = ids_smem[k]
      mosaic.copy_valid_row(table_ref, zero_ref, jnp.maximum(row, 0), row >= 0, rows, k,
                            rows_barrier, col0=col0)
      return carry

    jax.lax.fori_loop(0, block, issue, 0)
    plgpu.barrier_wait(rows_barrier)
    if all(buf.shape[1] == width for (_, width), buf in zip(chunks, rows)):
      for (c0, width), buf in zip(chunks, rows):
        plgpu.copy_smem_to_gmem(buf, out_ref.at[pl.ds(start, block), pl.ds(col0 + c0, width)])
    else:
      def store(k, carry):
        mosaic.store_row(rows, k, out_ref, start + k, columns, col0=col0)
        return carry

      jax.lax.fori_loop(0, block, store, 0)
    plgpu.wait_smem_to_gmem(0)

  out = mosaic.kernel(
      embedlib_gather_mosaic,
      out_type=out_struct((n, features), table.dtype, flat, table),
      grid=grid * (features // columns),
      scratch=[
          plgpu.SMEM((block,), jnp.int32),
          *mosaic.row_buffers(block, columns, table.dtype),
          plgpu.Barrier(num_arrivals=1),
          plgpu.Barrier(num_arrivals=block * len(chunks)),
      ],
      interpret=interpret,
  )(flat, table, zero)
  # The interpreter's results come back untyped for shard_map: type them.
  out = match_varying(out, flat, table)[0]
  return out.reshape(ids.shape + (features,))
