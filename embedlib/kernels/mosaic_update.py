"""Mosaic GPU sparse update: each run of equal ids reduced and its row updated, in one kernel.

The GPU's sorted update (``optim/sorted_update.py``) sorts the ids, then
sums each run of equal rows with a scan, runs the rule on every sorted
position and writes the runs' rows: several ``[ids, features]`` buffers
through global memory. Here, as in FBGEMM's fused backward, one program
takes a block of runs and, for each, copies its gradient rows into shared
memory with TMA (in sorted, that is original, order), adds them in
registers, applies the row-wise rule and writes the table row (and Adam's
moment rows) in place: table and table slots are aliased to outputs. Each
run owns its row, so no two writes collide: nothing is summed by atomics
and every run gives the same bits. A run of one or two ids is summed as the
scan sums it, so the rows are the XLA ops' bit for bit there; the row's sum
of squares (row-wise AdaGrad) is reduced across lanes in another order, an
ulp or so apart.

Per-row values below a TMA copy's 16 bytes (AdaGrad's accumulator, Adam's
step count) stay outside: XLA gathers what the runs need before the kernel
(the old accumulator; Adam's bias corrections ``1 - b ** t``, computed by
the rule's own expression) and writes the new values after it, at distinct
rows (``unique_indices``).

A hidden-sharded rank holds a column slice of every row: it passes the
slice of the gradients as ``grads`` and, for AdaGrad, whose scale needs the
whole row, the whole gradient rows as ``sq_grads`` (summed alongside, for
the sum of squares only).

Equivalent JAX code, for run ``u`` of sorted positions ``starts[u]:ends[u]``
owning table row ``rows[u]``::

    g = sum(grads[src[j]] for j in range(starts[u], ends[u]))   # in order
    # SGD
    table[rows[u]] += -lr * g
    # AdaGrad (s: the same sum over sq_grads, or g)
    acc = old_acc[u] + sum(s * s) / features
    table[rows[u]] += -(lr / (sqrt(acc) + eps)) * g
    # LazyAdam, c1 = 1 - b1 ** t, c2 = 1 - b2 ** t
    m[rows[u]] = b1 * m[rows[u]] + (1 - b1) * g
    v[rows[u]] = b2 * v[rows[u]] + (1 - b2) * g * g
    table[rows[u]] += -lr * (m[rows[u]] / c1[u]) / (sqrt(v[rows[u]] / c2[u]) + eps)
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from embedlib.kernels import mosaic
from embedlib.sharding import match_varying, out_struct

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
SGD, ADAGRAD, ADAM = "sgd", "adagrad", "adam"
#: The table slots each rule updates in place (``[rows, width]`` float32).
TABLE_SLOTS = {SGD: (), ADAGRAD: (), ADAM: ("m", "v")}
#: Shared memory the row buffers may take: a block then fits an H200 SM's 227 KiB.
SMEM_BYTES = 160 * 1024


def _has_api() -> bool:
  # Mosaic GPU kernels lower through ``mpmd_map`` alone on jax 0.12:
  # ``pallas_call`` has ``input_output_aliases`` but no Mosaic GPU lowering
  # rule (its CUDA lowering asserts), and its interpreter runs every grid
  # point as program 0; ``plgpu.kernel`` / ``pl.kernel`` alias nothing, and
  # the mutable reference they take in place of an alias is refused inside
  # shard_map. So the private entry point that aliases, checked to take the
  # argument; without it the XLA ops run. jax 0.10 has neither the
  # interpreter nor 16-byte copies.
  if _mpmd_map is None or not mosaic.has_interpreter():
    return False
  try:
    return "input_output_aliases" in inspect.signature(_mpmd_map).parameters
  except (TypeError, ValueError):
    return False


def _row_floats(width: int) -> int:
  return sum(mosaic.lanes(w) for _, w in mosaic.column_chunks(width))


def smem_bytes(width: int, *, rule: str, sq_width: int = 0) -> int:
  """Bytes of the shared-memory row buffers for rows ``width`` wide (and ``sq_grads``').

  >>> smem_bytes(100, rule=ADAM)   # 8 gradient rows, table, m, v: 11 rows of 128 lanes
  5632
  """
  rows = (GROUP + 1 + len(TABLE_SLOTS[rule])) * _row_floats(width)
  return 4 * (rows + GROUP * _row_floats(sq_width))


def supports(table_shape, dtype, *, rule: str = SGD, sq_width: int = 0) -> bool:
  """Whether the kernel updates a ``[rows, width]`` table of ``dtype``: float32, 16-byte rows.

  ``sq_width``: the width of ``sq_grads`` (AdaGrad on a column slice), 0 if none.

  >>> supports((10, 3), jnp.float32), supports((10, 128), jnp.bfloat16)
  (False, False)
  """
  f32 = jnp.float32
  return (_has_api() and jnp.dtype(dtype) == f32 and mosaic.supports(table_shape, dtype)
          and (not sq_width or mosaic.supports((1, sq_width), f32))
          and smem_bytes(table_shape[1], rule=rule, sq_width=sq_width) <= SMEM_BYTES)


def fused_update(table, grads, src, starts, ends, rows, lr, *, rule: str, table_slots=(),
                 per_run=(), sq_grads=None, eps: float = 0.0, b1: float = 0.0,
                 b2: float = 0.0, features: int, interpret: bool = False):
  """Reduces each run's gradient rows and applies ``rule`` to its table row, in place.

  Args:
    table: float32 ``[num_rows, width]`` (`supports`); donated to the result.
    grads: float32 ``[n, width]``, one gradient row per id.
    src: int32 ``[n]``, the row of ``grads`` at each sorted position.
    starts, ends: int32 ``[u]``, each run's sorted positions; empty runs
      (``starts == ends``) do nothing.
    rows: int32 ``[u]``, each run's table row; one past the table (or more)
      for runs to skip. Distinct among the runs written.
    lr: float32 scalar.
    rule: `SGD`, `ADAGRAD` or `ADAM`.
    table_slots: the rule's `TABLE_SLOTS`, float32 ``[num_rows, width]``
      each, donated like the table (Adam's ``m``, ``v``).
    per_run: float32 ``[u]`` values per run: AdaGrad's old accumulator;
      Adam's ``(1 - b1 ** t, 1 - b2 ** t)``; none for SGD.
    sq_grads: float32 ``[n, features]``, whole gradient rows whose run sums'
      squares AdaGrad takes (a column slice's ``grads`` lacks the rest), or
      None to take ``grads``'.
    eps, b1, b2: the rule's hyperparameters.
    features: the logical row width the sum of squares is averaged over.
    interpret: run in Mosaic GPU's interpreter (CPU, jax >= 0.11).

  Returns:
    ``(table, table_slots, new_acc)``: the updated table and slots, and for
    AdaGrad the ``[u]`` new accumulators (None otherwise).
  """
  if rule not in TABLE_SLOTS:
    raise ValueError(f"fused_update: rule={rule!r}; use one of {sorted(TABLE_SLOTS)} "
                     "(other rules take sorted_update's XLA ops).")
  num_per_run = {SGD: 0, ADAGRAD: 1, ADAM: 2}[rule]
  if len(per_run) != num_per_run or len(table_slots) != len(TABLE_SLOTS[rule]):
    raise ValueError(f"fused_update: rule {rule!r} takes {num_per_run} per-run values and "
                     f"table slots {TABLE_SLOTS[rule]}; got {len(per_run)} and "
                     f"{len(table_slots)}.")
  num_rows, width = table.shape
  num = starts.shape[0]
  grid = pl.cdiv(num, BLOCK)
  pad = grid * BLOCK - num
  starts = jnp.pad(starts.astype(jnp.int32), (0, pad))
  ends = jnp.pad(ends.astype(jnp.int32), (0, pad))
  rows = jnp.pad(rows.astype(jnp.int32), (0, pad), constant_values=num_rows)
  per_run = [jnp.pad(x.astype(jnp.float32), (0, pad), constant_values=1.0) for x in per_run]
  scalars = jnp.pad(jnp.asarray(lr, jnp.float32).reshape(1), (0, 3))   # a 16-byte copy unit
  src = src.astype(jnp.int32)
  sources = [grads, jnp.zeros((1, width), jnp.float32)]
  if sq_grads is not None:
    sources += [sq_grads, jnp.zeros((1, sq_grads.shape[1]), jnp.float32)]
  state = [table, *table_slots]
  operands = match_varying(starts, ends, rows, *per_run, scalars, src, *sources, *state)
  # What the accumulators are computed from: they vary as these do, not as
  # the table: a hidden rank's column slice gets the whole row's, the same
  # on every rank.
  by_run = [starts, ends, rows, *per_run, scalars, src, sources[-2]]
  num_in = len(operands)
  chunks = mosaic.column_chunks(width)
  sq_chunks = mosaic.column_chunks(sq_grads.shape[1]) if sq_grads is not None else []
  last = src.shape[0] - 1
  meta = 3 + num_per_run

  def body(*refs):
    meta_refs = refs[:meta]
    scalars_ref, src_ref = refs[meta:meta + 2]
    sources_refs = refs[meta + 2:num_in - len(state)]
    outs = refs[num_in:num_in + len(state)]   # aliased to the inputs: updated in place
    new_acc_ref = refs[num_in + len(state)] if rule == ADAGRAD else None
    scratch = list(refs[num_in + len(state) + (rule == ADAGRAD):])
    smem = [scratch.pop(0) for _ in range(meta + (rule == ADAGRAD))]
    meta_barrier, rows_barrier, state_barrier = scratch[-3:]
    bufs = iter(scratch[:-3])
    take = lambda count: [next(bufs) for _ in range(count)]
    gbufs, sbufs = take(len(chunks)), take(len(sq_chunks))
    state_bufs = [take(len(chunks)) for _ in state]
    first = mosaic.block_index() * BLOCK
    for ref, buf in zip(meta_refs, smem):
      mosaic.copy_flat(ref, first, buf, meta_barrier)
    # The padded lanes of the gradient buffers stay zero (copies fill the
    # row's own columns only), so the sum of squares sees the row alone.
    for (_, w), buf in [*zip(chunks, gbufs), *zip(sq_chunks, sbufs)]:
      for i in range(GROUP):
        buf[i] = mosaic.zero_row(mosaic.lanes(w), jnp.float32)
    plgpu.commit_smem()
    plgpu.barrier_wait(meta_barrier)
    lr = scalars_ref[0]
    copies = [(sources_refs[0], sources_refs[1], gbufs)]
    if sq_chunks:
      copies.append((sources_refs[2], sources_refs[3], sbufs))

    def one_run(k, carry):
      start, end, row = smem[0][k], smem[1][k], smem[2][k]

      def one_group(g, sums):
        plgpu.commit_smem()   # the previous group's reads precede the next copies
        base = start + g * GROUP
        for i in range(GROUP):
          j = jnp.minimum(base + i, last)
          for ref, zero_ref, dst in copies:
            mosaic.copy_valid_row(ref, zero_ref, src_ref[j], base + i < end, dst, i,
                                  rows_barrier)
        plgpu.barrier_wait(rows_barrier)
        for i in range(GROUP):
          sums = [[a + buf[i] for a, buf in zip(s, dst)]
                  for s, (_, _, dst) in zip(sums, copies)]
        return sums

      zeros = [[mosaic.zero_row(mosaic.lanes(w), jnp.float32) for _, w in cs]
               for cs in (chunks, sq_chunks)[:len(copies)]]
      sums = jax.lax.fori_loop(0, (end - start + GROUP - 1) // GROUP, one_group, zeros)
      g = sums[0]
      if rule == ADAGRAD:
        sq = sum(jnp.sum(a * a) for a in sums[-1])
        acc_new = smem[3][k] + sq / features
        scale = -(lr / (jnp.sqrt(acc_new) + eps))
        smem[meta][k] = acc_new
      elif rule == SGD:
        scale = -lr

      @pl.when(row < num_rows)
      def _():
        for ref, dst in zip(outs, state_bufs):
          mosaic.copy_row(ref, row, dst, 0, state_barrier)
        plgpu.barrier_wait(state_barrier)
        for c, a in enumerate(g):
          rows_now = [dst[c] for dst in state_bufs]
          if rule == ADAM:
            c1, c2 = smem[3][k], smem[4][k]
            m = b1 * rows_now[1][0] + (1 - b1) * a
            v = b2 * rows_now[2][0] + (1 - b2) * a * a
            rows_now[1][0], rows_now[2][0] = m, v
            rows_now[0][0] = rows_now[0][0] + -lr * (m / c1) / (jnp.sqrt(v / c2) + eps)
          else:
            rows_now[0][0] = rows_now[0][0] + scale * a
        plgpu.commit_smem()
        for ref, dst in zip(outs, state_bufs):
          for (c0, w), buf in zip(chunks, dst):
            plgpu.copy_smem_to_gmem(buf.at[pl.ds(0, 1), pl.ds(0, w)],
                                    ref.at[pl.ds(row, 1), pl.ds(c0, w)])
        # The buffers are the next run's: their copies out must have read them.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      return carry

    jax.lax.fori_loop(0, BLOCK, one_run, 0)
    if rule == ADAGRAD:
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(smem[meta], new_acc_ref.at[pl.ds(first, BLOCK)])
    plgpu.wait_smem_to_gmem(0)

  scratch = [
      *[plgpu.SMEM((BLOCK,), jnp.int32)] * 3,
      *[plgpu.SMEM((BLOCK,), jnp.float32)] * (num_per_run + (rule == ADAGRAD)),
      *mosaic.row_buffers(GROUP, width, jnp.float32, pad=True),
      *(mosaic.row_buffers(GROUP, sq_grads.shape[1], jnp.float32, pad=True)
        if sq_chunks else []),
      *[b for _ in state for b in mosaic.row_buffers(1, width, jnp.float32, pad=True)],
      plgpu.Barrier(num_arrivals=meta),
      plgpu.Barrier(num_arrivals=GROUP * (len(chunks) + len(sq_chunks))),
      plgpu.Barrier(num_arrivals=len(state) * len(chunks)),
  ]
  out_shape = [out_struct(x.shape, jnp.float32, *operands) for x in state]
  if rule == ADAGRAD:
    out_shape.append(out_struct((grid * BLOCK,), jnp.float32, *by_run))

  def embedlib_fused_update_mosaic(*refs):
    pl.run_scoped(functools.partial(body, *refs), *scratch)

  extra = {"interpret": mosaic.interpret_params()} if interpret else {}
  # ``plgpu.kernel`` less its wrapper, plus the aliasing of the table and
  # slots to outputs (`_has_api`). Scratch is scoped, as ``plgpu.kernel`` does.
  with _check_vma(False):
    outs = _mpmd_map(
        [(plgpu.Mesh(grid=(grid,), grid_names=(mosaic.BLOCKS,)), embedlib_fused_update_mosaic)],
        tuple(out_shape),
        input_output_aliases={num_in - len(state) + i: i for i in range(len(state))},
        compiler_params=plgpu.CompilerParams(),
        name="embedlib_fused_update_mosaic",
        **extra,
    )(*operands)
  # The interpreter's results come back untyped for shard_map: type them.
  new_acc = match_varying(outs[len(state)], *by_run)[0][:num] if rule == ADAGRAD else None
  outs = match_varying(*outs[:len(state)], *operands)[:len(state)]
  return outs[0], tuple(outs[1:]), new_acc
