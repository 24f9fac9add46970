"""Mosaic GPU pooled bag: ``pooled[b] = sum_l coef[b, l] * table[ids[b, l]]``.

The combiner's coefficients (`bags.bag_coefficients`: the weight over
the sum or root of squares of the bag's valid weights, 0 for padding) are
computed outside the kernel, a ``[batch, bag]`` array: the kernel only
sums scaled rows. Each program takes a block of bags; for each bag it
copies a group of its rows into shared memory with TMA (the zero row for
padding), waits, adds ``coef * row`` to a float32 accumulator held in
registers across the warpgroup, and moves on to the next group, so the
``[batch, bag, features]`` rows are never written out. Each pooled row is
written with one TMA copy. Terms are added in slot order, as
`bag_xla` sums them. Rows too wide for the buffers in one block's shared
memory are split by columns (`mosaic.program_columns`): each program then
sums its block's bags over its own columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from embedlib.kernels import mosaic
from embedlib.sharding import match_varying, out_struct

#: Rows of one bag copied per wait (the bag is padded to a multiple).
GROUP = 8


def bag_mosaic(table: jax.Array, ids: jax.Array, coef: jax.Array, *,
               interpret: bool = False) -> jax.Array:
  """Pooled bag lookup as a Mosaic GPU kernel (`mosaic.supports` tables only).

  Equivalent JAX code (`embedlib.kernels.bag_reference`)::

    rows = gather_reference(table, ids)                    # zeros for invalid ids
    pooled = jnp.einsum("bl,blf->bf", coef, rows)          # summed slot by slot

  Args:
    table: ``[num_embeddings, features]``; rows a multiple of 16 bytes.
    ids: int ``[batch, bag]``; ids outside ``[0, num_embeddings)`` are padding.
    coef: float32 ``[batch, bag]``, 0 at padding (`bags.bag_coefficients`).
    interpret: run in Mosaic GPU's interpreter (CPU, jax >= 0.11).

  Returns:
    ``[batch, features]`` in ``table.dtype`` (accumulated in float32).
  """
  num_embeddings, features = table.shape
  batch, bag = ids.shape
  if batch == 0 or bag == 0 or num_embeddings == 0:
    return jnp.zeros((batch, features), table.dtype)
  valid = (ids >= 0) & (ids < num_embeddings)
  ids = jnp.where(valid, ids, -1).astype(jnp.int32)
  group = min(GROUP, bag)
  slots = -(-bag // group) * group
  block = mosaic.block_rows(batch, 0, most=32)
  grid = pl.cdiv(batch, block)
  pad = ((0, grid * block - batch), (0, slots - bag))
  ids = jnp.pad(ids, pad, constant_values=-1).reshape(-1)
  coef = jnp.pad(coef.astype(jnp.float32), pad).reshape(-1)
  per_block = block * slots
  itemsize = table.dtype.itemsize
  columns = mosaic.program_columns(
      features, table.dtype,
      lambda w: 8 * per_block + (group + block) * mosaic.row_floats(w) * itemsize)
  zero = jnp.zeros((1, columns), table.dtype)
  ids, coef, table, zero = match_varying(ids, coef, table, zero)
  chunks = mosaic.column_chunks(columns)

  def embedlib_bag_mosaic(ids_ref, coef_ref, table_ref, zero_ref, out_ref,
                          ids_smem, coef_smem, *rest):
    n = len(chunks)
    rows, stage, (meta_barrier, rows_barrier) = rest[:n], rest[n:2 * n], rest[2 * n:]
    b, col0 = mosaic.block_and_column(columns, features)
    start = b * block
    for src, dst in ((ids_ref, ids_smem), (coef_ref, coef_smem)):
      mosaic.copy_flat(src, start * slots, dst, meta_barrier)
    plgpu.barrier_wait(meta_barrier)

    def one_bag(k, carry):
      def one_group(g, acc):
        first = k * slots + g * group
        # The previous group's reads of the buffers are done before TMA
        # overwrites them.
        plgpu.commit_smem()
        for i in range(group):
          row = ids_smem[first + i]
          mosaic.copy_valid_row(table_ref, zero_ref, jnp.maximum(row, 0), row >= 0, rows, i,
                                rows_barrier, col0=col0)
        plgpu.barrier_wait(rows_barrier)
        for i in range(group):
          c = coef_smem[first + i]
          acc = [a + c * buf[i].astype(jnp.float32) for a, buf in zip(acc, rows)]
        return acc

      zeros = [mosaic.zero_row(mosaic.lanes(w), table.dtype) for _, w in chunks]
      acc = jax.lax.fori_loop(0, slots // group, one_group, zeros)
      for a, buf in zip(acc, stage):
        buf[k] = a.astype(buf.dtype)
      plgpu.commit_smem()

      mosaic.store_row(stage, k, out_ref, start + k, columns, col0=col0)
      return carry

    jax.lax.fori_loop(0, block, one_bag, 0)
    plgpu.wait_smem_to_gmem(0)

  out = mosaic.kernel(
      embedlib_bag_mosaic,
      out_type=out_struct((batch, features), table.dtype, ids, coef, table),
      grid=grid * (features // columns),
      scratch=[
          plgpu.SMEM((per_block,), jnp.int32),
          plgpu.SMEM((per_block,), jnp.float32),
          *mosaic.row_buffers(group, columns, table.dtype, pad=True),
          *mosaic.row_buffers(block, columns, table.dtype, pad=True),
          plgpu.Barrier(num_arrivals=2 * len(mosaic.flat_chunks(per_block))),
          plgpu.Barrier(num_arrivals=group * len(chunks)),
      ],
      interpret=interpret,
  )(ids, coef, table, zero)
  # The interpreter's results come back untyped for shard_map: type them.
  return match_varying(out, ids, coef, table)[0]
