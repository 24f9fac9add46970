"""Mosaic GPU sparse update: each run of equal ids reduced and its row updated, in one kernel.

The GPU's sorted update (``optim/sorted_update.py``) sorts the ids, then
sums each run of equal rows with a scan, runs the rule on every sorted
position and writes the runs' rows: several ``[ids, features]`` buffers
through global memory. Here, as in FBGEMM's fused backward, one program
takes a block of runs and, for each, copies its gradient rows into shared
memory with TMA (in sorted, that is original, order), adds them in
registers, applies the row-wise rule and writes the table row in place
(the table is aliased to the output). Each run owns its row, so no two
writes collide: nothing is summed by atomics and every run gives the same
bits. A run of one or two ids is summed as the scan sums it, so the table
is the XLA ops' bit for bit there; the row's sum of squares (row-wise
AdaGrad) is reduced across lanes in another order, an ulp or so apart.

Row slots (AdaGrad's accumulator) are one float per row, below a TMA
copy's 16 bytes: XLA gathers the runs' old values before the kernel and
writes the new ones after it, at distinct rows (``unique_indices``).

Equivalent JAX code, for run ``u`` of sorted positions ``starts[u]:ends[u]``
owning table row ``rows[u]``::

    g = sum(grads[src[j]] for j in range(starts[u], ends[u]))  # in order
    acc = old_acc[u] + sum(g * g) / features                   # AdaGrad
    table[rows[u]] += -(lr / (sqrt(acc) + eps)) * g            # SGD: -lr * g
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from embedlib.kernels import mosaic
from embedlib.sharding import match_varying, out_struct

# jax >= 0.11 internals (``supports`` is False without them): the kernel
# entry point that aliases an input to an output.
try:
  from jax._src.config import _check_vma
  from jax._src.pallas.mpmd import _mpmd_map
except ImportError:
  _mpmd_map = None

#: Gradient rows copied per wait.
GROUP = 8
#: Runs per program (32 int32s: one whole copy unit on every jax).
BLOCK = 32
#: The rules the kernel implements, by name.
SGD, ADAGRAD = "sgd", "adagrad"


def supports(table_shape, dtype) -> bool:
  """Whether the kernel updates a ``[rows, features]`` table of ``dtype``: float32, 16-byte rows.

  >>> supports((10, 3), jnp.float32), supports((10, 128), jnp.bfloat16)
  (False, False)
  """
  return (_mpmd_map is not None and mosaic.has_interpreter() and jnp.dtype(dtype) == jnp.float32
          and mosaic.supports(table_shape, dtype))


def fused_update(table, grads, src, starts, ends, rows, old_acc, lr, *, rule: str,
                 eps: float = 0.0, features: int, interpret: bool = False):
  """Reduces each run's gradient rows and applies ``rule`` to its table row, in place.

  Args:
    table: float32 ``[num_rows, width]`` (`supports`); donated to the result.
    grads: float32 ``[n, width]``, one gradient row per id.
    src: int32 ``[n]``, the row of ``grads`` at each sorted position.
    starts, ends: int32 ``[u]``, each run's sorted positions; empty runs
      (``starts == ends``) do nothing.
    rows: int32 ``[u]``, each run's table row; one past the table (or more)
      for runs to skip. Distinct among the runs written.
    old_acc: float32 ``[u]``, each run's accumulator (AdaGrad; ignored by SGD).
    lr: float32 scalar.
    rule: `SGD` or `ADAGRAD`.
    eps: AdaGrad's ``eps``.
    features: the logical row width the sum of squares is averaged over.
    interpret: run in Mosaic GPU's interpreter (CPU, jax >= 0.11).

  Returns:
    ``(table, new_acc)``: the updated table and ``[u]`` accumulators.
  """
  if rule not in (SGD, ADAGRAD):
    raise ValueError(f"fused_update: rule={rule!r}; use {SGD!r} or {ADAGRAD!r} "
                     "(other rules take sorted_update's XLA ops).")
  num_rows, width = table.shape
  num = starts.shape[0]
  grid = pl.cdiv(num, BLOCK)
  pad = grid * BLOCK - num
  starts = jnp.pad(starts.astype(jnp.int32), (0, pad))
  ends = jnp.pad(ends.astype(jnp.int32), (0, pad))
  rows = jnp.pad(rows.astype(jnp.int32), (0, pad), constant_values=num_rows)
  old_acc = jnp.pad(old_acc.astype(jnp.float32), (0, pad))
  scalars = jnp.pad(jnp.asarray(lr, jnp.float32).reshape(1), (0, 3))   # a 16-byte copy unit
  zero = jnp.zeros((1, width), jnp.float32)
  src = src.astype(jnp.int32)
  operands = match_varying(starts, ends, rows, old_acc, scalars, src, grads, zero, table)
  chunks = mosaic.column_chunks(width)
  last = src.shape[0] - 1

  def body(first, starts_ref, ends_ref, rows_ref, acc_ref, scalars_ref, src_ref,
           grads_ref, zero_ref, _table_in, new_acc_ref, table_ref, starts_smem, ends_smem,
           rows_smem, acc_smem, new_acc_smem, *rest):
    n = len(chunks)
    gbufs, tbufs = rest[:n], rest[n:2 * n]
    meta_barrier, rows_barrier, table_barrier = rest[2 * n:]
    for ref, buf in ((starts_ref, starts_smem), (ends_ref, ends_smem), (rows_ref, rows_smem),
                     (acc_ref, acc_smem)):
      mosaic.copy_flat(ref, first, buf, meta_barrier)
    # The padded lanes of the gradient buffers stay zero (copies fill the
    # row's own columns only), so the sum of squares sees the row alone.
    for (_, w), buf in zip(chunks, gbufs):
      for i in range(GROUP):
        buf[i] = mosaic.zero_row(mosaic.lanes(w), jnp.float32)
    plgpu.commit_smem()
    plgpu.barrier_wait(meta_barrier)
    lr = scalars_ref[0]

    def one_run(k, carry):
      start, end, row = starts_smem[k], ends_smem[k], rows_smem[k]

      def one_group(g, acc):
        plgpu.commit_smem()   # the previous group's reads precede the next copies
        base = start + g * GROUP
        for i in range(GROUP):
          j = jnp.minimum(base + i, last)
          mosaic.copy_valid_row(grads_ref, zero_ref, src_ref[j], base + i < end, gbufs, i,
                                rows_barrier)
        plgpu.barrier_wait(rows_barrier)
        for i in range(GROUP):
          acc = [a + buf[i] for a, buf in zip(acc, gbufs)]
        return acc

      zeros = [mosaic.zero_row(mosaic.lanes(w), jnp.float32) for _, w in chunks]
      g = jax.lax.fori_loop(0, (end - start + GROUP - 1) // GROUP, one_group, zeros)
      if rule == ADAGRAD:
        sq = sum(jnp.sum(a * a) for a in g)
        acc_new = acc_smem[k] + sq / features
        scale = -(lr / (jnp.sqrt(acc_new) + eps))
        new_acc_smem[k] = acc_new
      else:
        scale = -lr

      @pl.when(row < num_rows)
      def _():
        mosaic.copy_row(table_ref, row, tbufs, 0, table_barrier)
        plgpu.barrier_wait(table_barrier)
        for a, buf in zip(g, tbufs):
          buf[0] = buf[0] + scale * a
        plgpu.commit_smem()
        for (c0, w), buf in zip(chunks, tbufs):
          plgpu.copy_smem_to_gmem(buf.at[pl.ds(0, 1), pl.ds(0, w)],
                                  table_ref.at[pl.ds(row, 1), pl.ds(c0, w)])
        # The buffer is the next run's: its copy out must have read it.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      return carry

    jax.lax.fori_loop(0, BLOCK, one_run, 0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(new_acc_smem, new_acc_ref.at[pl.ds(first, BLOCK)])
    plgpu.wait_smem_to_gmem(0)

  scratch = [
      plgpu.SMEM((BLOCK,), jnp.int32),
      plgpu.SMEM((BLOCK,), jnp.int32),
      plgpu.SMEM((BLOCK,), jnp.int32),
      plgpu.SMEM((BLOCK,), jnp.float32),
      plgpu.SMEM((BLOCK,), jnp.float32),
      *mosaic.row_buffers(GROUP, width, jnp.float32, pad=True),
      *mosaic.row_buffers(1, width, jnp.float32, pad=True),
      plgpu.Barrier(num_arrivals=4),
      plgpu.Barrier(num_arrivals=GROUP * len(chunks)),
      plgpu.Barrier(num_arrivals=len(chunks)),
  ]

  def embedlib_fused_update_mosaic(*refs):
    pl.run_scoped(functools.partial(body, mosaic.block_index() * BLOCK, *refs), *scratch)

  extra = {"interpret": mosaic.interpret_params()} if interpret else {}
  # ``plgpu.kernel`` less its wrapper, plus the aliasing of the table to an
  # output that it does not expose (a mutable reference in its place is
  # refused inside shard_map). Scratch is scoped, as ``plgpu.kernel`` does.
  with _check_vma(False):
    new_acc, out_table = _mpmd_map(
        [(plgpu.Mesh(grid=(grid,), grid_names=(mosaic.BLOCKS,)), embedlib_fused_update_mosaic)],
        (out_struct((grid * BLOCK,), jnp.float32, *operands),
         out_struct(table.shape, jnp.float32, *operands)),
        input_output_aliases={len(operands) - 1: 1},
        compiler_params=plgpu.CompilerParams(),
        name="embedlib_fused_update_mosaic",
        **extra,
    )(*operands)
  # The interpreter's results come back untyped for shard_map: type them.
  out_table, new_acc = match_varying(out_table, new_acc, *operands)[:2]
  return out_table, new_acc[:num]
