"""Mosaic GPU backward of the lookups: one summed gradient row per distinct id.

``sums[u] = sum over j in segment u of coef[j] * grads[src[j]]`` for the
segments of equal valid ids that `backward.segments` finds (a stable sort):
each program takes a block of segments and, for each, copies a group of
its gradient rows into shared memory with TMA, waits, and adds them in
sorted (that is, original) order to a float32 accumulator in registers,
then writes the segment's row with one TMA copy. The ``[segments,
features]`` sums are then written into the zero table gradient by XLA, at
distinct rows: no two writes collide, so nothing is summed by atomics and
the result is the same on every run. Rows too wide for the buffers in one
block's shared memory are split by columns (`mosaic.program_columns`): each
program then sums its block's segments over its own columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from embedlib.kernels import mosaic
from embedlib.kernels.backward import segments
from embedlib.sharding import match_varying, out_struct

#: Gradient rows copied per wait.
GROUP = 8
#: Segments per program.
BLOCK = 32


def _segment_rows(grads, starts, ends, src, coef, *, interpret):
  """``[len(starts), features]``: row ``u`` sums ``coef[j] * grads[src[j]]`` over ``starts[u]:ends[u]``."""
  features = grads.shape[1]
  num = starts.shape[0]
  grid = pl.cdiv(num, BLOCK)
  pad = grid * BLOCK - num
  starts = jnp.pad(starts, (0, pad))
  ends = jnp.pad(ends, (0, pad))
  itemsize = grads.dtype.itemsize
  columns = mosaic.program_columns(
      features, grads.dtype,
      lambda w: 8 * BLOCK + (GROUP * itemsize + BLOCK * 4) * mosaic.row_floats(w))
  zero = jnp.zeros((1, columns), grads.dtype)
  starts, ends, src, coef, grads, zero = match_varying(starts, ends, src, coef, grads, zero)
  chunks = mosaic.column_chunks(columns)
  last = src.shape[0] - 1

  def embedlib_segment_sum_mosaic(starts_ref, ends_ref, src_ref, coef_ref, grads_ref, zero_ref,
                                  out_ref, starts_smem, ends_smem, *rest):
    n = len(chunks)
    rows, stage, (meta_barrier, rows_barrier) = rest[:n], rest[n:2 * n], rest[2 * n:]
    b, col0 = mosaic.block_and_column(columns, features)
    first = b * BLOCK
    mosaic.copy_flat(starts_ref, first, starts_smem, meta_barrier)
    mosaic.copy_flat(ends_ref, first, ends_smem, meta_barrier)
    plgpu.barrier_wait(meta_barrier)

    def one_segment(k, carry):
      start, end = starts_smem[k], ends_smem[k]

      def one_group(g, acc):
        plgpu.commit_smem()   # the previous group's reads precede the next copies
        base = start + g * GROUP
        coefs = []
        for i in range(GROUP):
          j = jnp.minimum(base + i, last)
          inside = base + i < end
          mosaic.copy_valid_row(grads_ref, zero_ref, src_ref[j], inside, rows, i, rows_barrier,
                                col0=col0)
          coefs.append(jnp.where(inside, coef_ref[j], 0.0))
        plgpu.barrier_wait(rows_barrier)
        for i in range(GROUP):
          acc = [a + coefs[i] * buf[i].astype(jnp.float32) for a, buf in zip(acc, rows)]
        return acc

      zeros = [mosaic.zero_row(mosaic.lanes(w), grads.dtype) for _, w in chunks]
      acc = jax.lax.fori_loop(0, (end - start + GROUP - 1) // GROUP, one_group, zeros)
      for a, buf in zip(acc, stage):
        buf[k] = a
      plgpu.commit_smem()

      mosaic.store_row(stage, k, out_ref, first + k, columns, col0=col0)
      return carry

    jax.lax.fori_loop(0, BLOCK, one_segment, 0)
    plgpu.wait_smem_to_gmem(0)

  out = mosaic.kernel(
      embedlib_segment_sum_mosaic,
      out_type=out_struct((num, features), jnp.float32, starts, src, grads),
      grid=grid * (features // columns),
      scratch=[
          plgpu.SMEM((BLOCK,), jnp.int32),
          plgpu.SMEM((BLOCK,), jnp.int32),
          *mosaic.row_buffers(GROUP, columns, grads.dtype, pad=True),
          *mosaic.row_buffers(BLOCK, columns, jnp.float32, pad=True),
          plgpu.Barrier(num_arrivals=2),
          plgpu.Barrier(num_arrivals=GROUP * len(chunks)),
      ],
      interpret=interpret,
  )(starts, ends, src, coef, grads, zero)
  # The interpreter's results come back untyped for shard_map: type them.
  return match_varying(out, starts, src, coef, grads)[0]


def row_sums(grads: jax.Array, ids: jax.Array, num_embeddings: int, *,
             interpret: bool = False) -> jax.Array:
  """The summed gradient of each distinct valid id, in id order: the backward's reduction.

  Args:
    grads: ``[n, features]``, one gradient row per id.
    ids: int ``[n]``; ids outside ``[0, num_embeddings)`` are dropped.
    num_embeddings: rows of the table.
    interpret: run in Mosaic GPU's interpreter (CPU, jax >= 0.11).

  Returns:
    float32 ``[n, features]``: row ``u`` sums the ``u``-th smallest distinct
    id's rows; rows past the number of distinct ids are zero.
  """
  ids = ids.reshape(-1).astype(jnp.int32)
  order, starts, ends, _, _ = segments(ids, num_embeddings)
  return _segment_rows(grads, starts, ends, order, jnp.ones(ids.shape, jnp.float32),
                       interpret=interpret)


def segment_sum_mosaic(grads: jax.Array, src: jax.Array, ids: jax.Array, num_embeddings: int, *,
                       coef: jax.Array | None = None, dtype=None,
                       interpret: bool = False) -> jax.Array:
  """Table gradient ``out[r] = sum_{j: ids[j] == r} coef[j] * grads[src[j]]``, deterministically.

  Same contract as `backward.segment_sum_rows` (its equivalent JAX code),
  for `mosaic.supports` gradient rows.

  Args:
    grads: ``[m, features]`` cotangent rows.
    src: int ``[n]``, the row of ``grads`` each id takes its gradient from.
    ids: int ``[n]``, the table row each id was read from.
    num_embeddings: rows of the table gradient.
    coef: optional float ``[n]`` factor per id.
    dtype: dtype of the result (default ``grads.dtype``).
    interpret: run in Mosaic GPU's interpreter (CPU, jax >= 0.11).

  Returns:
    ``[num_embeddings, features]`` in ``dtype``; summed in float32.
  """
  dtype = grads.dtype if dtype is None else jnp.dtype(dtype)
  features = grads.shape[-1]
  ids = ids.reshape(-1).astype(jnp.int32)
  n = ids.shape[0]
  zeros = jnp.zeros((num_embeddings, features), dtype)
  if n == 0 or num_embeddings == 0 or grads.shape[0] == 0:
    return zeros
  order, starts, ends, rows, count = segments(ids, num_embeddings)
  src = src.reshape(-1).astype(jnp.int32)[order]
  coef = (jnp.ones((n,), jnp.float32) if coef is None
          else coef.reshape(-1).astype(jnp.float32)[order])
  sums = _segment_rows(grads, starts, ends, src, coef, interpret=interpret)
  # Distinct rows (each segment owns one); empty segments point past the end.
  rows = jnp.where(jnp.arange(n) < count, rows, num_embeddings)
  return zeros.at[rows].set(sums.astype(dtype), mode="drop", unique_indices=True)
