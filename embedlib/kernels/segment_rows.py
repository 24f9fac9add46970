"""Deterministic segment sums with many rows in flight (Triton): the backward's reduction.

``sum[u] = sum over j in run u of coef[j] * grads[src[j]]`` for runs of
equal ids in sorted order (``backward.segments``), then something done with
each run's sum (a *finish*: write it as a table-gradient row, as row ``u``
of the sums, or apply an optimizer rule to the run's table row:
``update_rows``). Every run's sum is finished by exactly one program and
written once: no atomics, the same bits on every run.

A hot id's run (Zipf ids: thousands of positions) summed by one program
would leave the rest of the GPU idle, so runs are cut into *pieces* of at
most ``variant.piece`` sorted positions (XLA's index arithmetic, `pieces`):

1. one program per ``variant.runs`` pieces loops over the positions of its
   pieces, ``variant.unroll`` a step, each step requesting ``runs x unroll``
   gradient rows at once (a ``[runs, chunk]`` tile per position and column
   chunk, `rows.column_chunks`) and adding them in float32, in sorted (that
   is original) order. A piece that is a whole run is finished here; the
   pieces of longer runs write their sums to a small buffer;
2. one program per long run adds its pieces' sums, ``variant.unroll`` pieces
   at a time, and finishes it.

Equivalent JAX code (``finish`` writing row ``u``)::

    order, starts, ends, rows, count = backward.segments(ids, num_embeddings)
    sums = [sum(coef[order[j]] * grads[src[order[j]]] for j in range(starts[u], ends[u]))
            for u in range(count)]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from embedlib.kernels import rows as rows_lib
from embedlib.kernels.backward import segments
from embedlib.kernels.rows import SegmentVariant
from embedlib.sharding import match_varying, out_struct


@dataclasses.dataclass(frozen=True)
class Pieces:
  """Runs cut into pieces (`pieces`). ``n`` pieces at most, ``long_cap`` long runs.

  Per piece: ``start``, ``end`` (sorted positions; empty past the last),
  ``run`` and ``slot`` (its row in the buffer of long runs' piece sums, -1
  for a piece that is a whole run). Per long run ``l``: ``long_runs[l]``
  (its run, -1 past the last); per run ``u``: ``first[u]``, its first slot,
  and ``count[u]``, its number of pieces.
  """

  start: jax.Array
  end: jax.Array
  run: jax.Array
  slot: jax.Array
  long_runs: jax.Array
  first: jax.Array
  count: jax.Array
  slots: int


def pieces(starts: jax.Array, ends: jax.Array, n: int, piece: int) -> Pieces:
  """Cuts runs ``starts[u]:ends[u]`` (of ``n`` sorted positions in all) into pieces of ``piece``.

  >>> p = pieces(jnp.array([0, 1, 6]), jnp.array([1, 6, 6]), 6, 2)
  >>> p.start.tolist(), p.end.tolist(), p.run.tolist()[:4], p.slot.tolist()[:4]
  ([0, 1, 3, 5, 0, 0], [1, 3, 5, 6, 0, 0], [0, 1, 1, 1], [-1, 0, 1, 2])
  >>> p.long_runs.tolist(), p.first.tolist(), p.count.tolist()
  ([1, -1, -1], [0, 0, 3], [1, 3, 0])
  """
  num = starts.shape[0]
  u = jnp.arange(num, dtype=jnp.int32)
  length = jnp.maximum(ends - starts, 0)
  count = (length + piece - 1) // piece
  first_piece = jnp.cumsum(count) - count
  total = jnp.sum(count)
  marks = jnp.full((n,), -1, jnp.int32).at[jnp.where(count > 0, first_piece, n)].set(
      u, mode="drop", unique_indices=True)
  run = jnp.maximum(lax.cummax(marks), 0)
  p = jnp.arange(n, dtype=jnp.int32)
  k = p - first_piece[run]
  inside = p < total
  start = jnp.where(inside, starts[run] + k * piece, 0)
  end = jnp.where(inside, jnp.minimum(start + piece, ends[run]), 0)
  long = count > 1
  long_count = jnp.where(long, count, 0)
  first = (jnp.cumsum(long_count) - long_count).astype(jnp.int32)
  slot = jnp.where(inside & long[run], first[run] + k, -1)
  long_cap = n // (piece + 1) + 1
  rank = jnp.cumsum(long) - long
  long_runs = jnp.full((long_cap,), -1, jnp.int32).at[jnp.where(long, rank, long_cap)].set(
      u, mode="drop", unique_indices=True)
  # A long run of L > piece positions has ceil(L / piece) < 2 L / piece pieces.
  slots = 2 * n // piece + 1
  return Pieces(start.astype(jnp.int32), end.astype(jnp.int32), run.astype(jnp.int32),
                slot.astype(jnp.int32), long_runs, first, count.astype(jnp.int32), slots)


class Finish:
  """What is done with each run's sum: the base of `WriteRows` and ``update_rows.Rule``.

  ``inputs``: arrays the kernels read (``[num]`` per run, scalars as
  ``[1]``); ``outputs``: arrays updated in place (aliased), returned.
  ``apply(input_refs, output_refs, runs, sums, mask)`` finishes runs
  ``runs`` (``[r]``) whose sums are ``sums`` (float32 ``[r, chunk]`` per
  column chunk) where ``mask``.
  """

  inputs: tuple = ()
  outputs: tuple = ()

  def apply(self, input_refs, output_refs, runs, sums, mask):
    raise NotImplementedError


class WriteRows(Finish):
  """Writes run ``u``'s sum as row ``rows[u]`` of ``out`` (row ``u`` when ``rows`` is None)."""

  def __init__(self, out: jax.Array, features: int, rows: jax.Array | None = None):
    self.inputs = () if rows is None else (rows,)
    self.outputs = (out,)
    self.chunks = rows_lib.column_chunks(features)

  def apply(self, input_refs, output_refs, runs, sums, mask):
    row = rows_lib.load_vector(input_refs[0], runs, mask) if input_refs else runs
    for (c0, width), s in zip(self.chunks, sums):
      rows_lib.store(output_refs[0], row, rows_lib.iota(width, c0), s, mask)


def _pieces_kernel(*refs, n, block, unroll, chunks, scaled, finish, num_inputs):
  start_ref, end_ref, run_ref, slot_ref, src_ref, *refs = refs
  coef_ref = refs.pop(0) if scaled else None
  grads_ref, *refs = refs
  # The outputs' aliased inputs come before the outputs, unread.
  num_out = len(finish.outputs)
  inputs, outputs = refs[:num_inputs], refs[num_inputs + num_out:num_inputs + 2 * num_out]
  sums_ref = refs[-1]
  p = rows_lib.iota(block, pl.program_id(0) * block)
  inside = p < n
  start = rows_lib.load_vector(start_ref, p, inside, 0)
  length = rows_lib.load_vector(end_ref, p, inside, 0) - start

  def step(s, accs):
    for u in range(unroll):
      j = s * unroll + u
      take = j < length
      src = rows_lib.load_vector(src_ref, start + j, take, 0)
      coef = rows_lib.load_vector(coef_ref, start + j, take, 0.0) if scaled else None
      tiles = [rows_lib.load(grads_ref, src, rows_lib.iota(w, c0), take).astype(jnp.float32)
               for c0, w in chunks]
      accs = [a + (coef[:, None] * t if scaled else t) for a, t in zip(accs, tiles)]
    return accs

  zeros = [jnp.zeros((block, w), jnp.float32) for _, w in chunks]
  accs = jax.lax.fori_loop(0, pl.cdiv(jnp.max(length), unroll), step, zeros)
  run = rows_lib.load_vector(run_ref, p, inside, 0)
  slot = rows_lib.load_vector(slot_ref, p, inside, -1)
  for (c0, w), acc in zip(chunks, accs):
    rows_lib.store(sums_ref, slot, rows_lib.iota(w, c0), acc, slot >= 0)
  finish.apply(inputs, outputs, run, accs, inside & (length > 0) & (slot < 0))


def _long_kernel(*refs, block, chunks, finish, num_inputs):
  long_ref, first_ref, count_ref, sums_ref, *refs = refs
  inputs, outputs = refs[:num_inputs], refs[num_inputs + len(finish.outputs):]
  run = long_ref[pl.program_id(0)]
  valid = run >= 0
  run = jnp.maximum(run, 0)
  first = first_ref[run]
  count = jnp.where(valid, count_ref[run], 0)

  def step(s, accs):
    k = rows_lib.iota(block, s * block)
    return [a + rows_lib.load(sums_ref, first + k, rows_lib.iota(w, c0), k < count)
            for a, (c0, w) in zip(accs, chunks)]

  zeros = [jnp.zeros((block, w), jnp.float32) for _, w in chunks]
  accs = jax.lax.fori_loop(0, pl.cdiv(count, block), step, zeros)
  totals = [jnp.sum(a, axis=0, keepdims=True) for a in accs]
  finish.apply(inputs, outputs, jnp.full((1,), run), totals, jnp.full((1,), valid))


def reduce_runs(grads, src, starts, ends, finish: Finish, *, coef=None,
                variant: SegmentVariant = SegmentVariant(), interpret: bool = False):
  """Sums each run's rows and finishes it (the module docstring's two kernels).

  Args:
    grads: ``[m, features]`` rows to sum, any float dtype.
    src: int32 ``[n]``, the row of ``grads`` at each sorted position.
    starts, ends: int32 ``[num]``, each run's sorted positions (empty runs
      ``starts == ends``).
    finish: what is done with each run's sum (`Finish`).
    coef: optional float32 ``[n]`` factor per sorted position.
    variant: piece length, pieces per program, unroll and warps.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    ``finish.outputs``, updated.
  """
  n, features = src.shape[0], grads.shape[1]
  plan = pieces(starts, ends, n, variant.piece)
  chunks = rows_lib.column_chunks(features)
  block = min(variant.runs, rows_lib.pow2(n))
  num_in, num_out = len(finish.inputs), len(finish.outputs)
  operands = [plan.start, plan.end, plan.run, plan.slot, src.astype(jnp.int32)]
  if coef is not None:
    operands.append(coef.astype(jnp.float32))
  operands = match_varying(*operands, grads, *finish.inputs, *finish.outputs)
  first_out = len(operands) - num_out
  params = rows_lib.compiler_params(variant.warps)
  outs = pl.pallas_call(
      functools.partial(_pieces_kernel, n=n, block=block, unroll=max(variant.unroll, 1),
                        chunks=chunks, scaled=coef is not None, finish=finish,
                        num_inputs=num_in),
      out_shape=[out_struct(x.shape, x.dtype, *operands) for x in operands[first_out:]]
      + [out_struct((plan.slots, features), jnp.float32, *operands)],
      grid=(pl.cdiv(n, block),),
      input_output_aliases={first_out + i: i for i in range(num_out)},
      compiler_params=params,
      interpret=interpret,
      name="embedlib_segment_rows",
  )(*operands)
  *outputs, sums = outs
  operands = match_varying(plan.long_runs, plan.first, plan.count, sums,
                           *operands[first_out - num_in:first_out], *outputs)
  first_out = len(operands) - num_out
  outputs = pl.pallas_call(
      functools.partial(_long_kernel, block=max(variant.unroll, 1), chunks=chunks,
                        finish=finish, num_inputs=num_in),
      out_shape=[out_struct(x.shape, x.dtype, *operands) for x in operands[first_out:]],
      grid=(plan.long_runs.shape[0],),
      input_output_aliases={first_out + i: i for i in range(num_out)},
      compiler_params=params,
      interpret=interpret,
      name="embedlib_segment_rows_long",
  )(*operands)
  return tuple(outputs)


def segment_sum_rows(grads: jax.Array, src: jax.Array, ids: jax.Array, num_embeddings: int, *,
                     coef: jax.Array | None = None, dtype=None,
                     variant: SegmentVariant = SegmentVariant(),
                     interpret: bool = False) -> jax.Array:
  """Table gradient ``out[r] = sum_{j: ids[j] == r} coef[j] * grads[src[j]]``, deterministically.

  Same contract as `backward.segment_sum_rows` (its equivalent JAX code).

  Args:
    grads: ``[m, features]`` cotangent rows.
    src: int ``[n]``, the row of ``grads`` each id takes its gradient from.
    ids: int ``[n]``, the table row each id was read from.
    num_embeddings: rows of the table gradient.
    coef: optional float ``[n]`` factor per id.
    dtype: dtype of the result (default ``grads.dtype``).
    variant: see `SegmentVariant`.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    ``[num_embeddings, features]`` in ``dtype``; summed in float32.

  >>> g = jnp.array([[1.0], [2.0], [4.0]])
  >>> segment_sum_rows(g, jnp.arange(3), jnp.array([1, 1, -1]), 3, interpret=True).tolist()
  [[0.0], [3.0], [0.0]]
  """
  dtype = grads.dtype if dtype is None else jnp.dtype(dtype)
  features = grads.shape[-1]
  ids = ids.reshape(-1).astype(jnp.int32)
  zeros = jnp.zeros((num_embeddings, features), dtype)
  if ids.shape[0] == 0 or num_embeddings == 0 or features == 0 or grads.shape[0] == 0:
    return zeros
  order, starts, ends, rows, _ = segments(ids, num_embeddings)
  src = src.reshape(-1).astype(jnp.int32)[order]
  if coef is not None:
    coef = coef.reshape(-1).astype(jnp.float32)[order]
  (out,) = reduce_runs(grads, src, starts, ends, WriteRows(zeros, features, rows), coef=coef,
                       variant=variant, interpret=interpret)
  return out


def row_sums(grads: jax.Array, ids: jax.Array, num_embeddings: int, *,
             variant: SegmentVariant = SegmentVariant(), interpret: bool = False) -> jax.Array:
  """The summed gradient of each distinct valid id, in id order (`backward_mosaic.row_sums`'s contract).

  Args:
    grads: ``[n, features]``, one gradient row per id.
    ids: int ``[n]``; ids outside ``[0, num_embeddings)`` are dropped.
    num_embeddings: rows of the table.
    variant: see `SegmentVariant`.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    float32 ``[n, features]``: row ``u`` sums the ``u``-th smallest distinct
    id's rows; rows past the number of distinct ids are zero.

  >>> row_sums(jnp.array([[1.0], [2.0], [4.0]]), jnp.array([2, 0, 2]), 3, interpret=True).tolist()
  [[2.0], [5.0], [0.0]]
  """
  ids = ids.reshape(-1).astype(jnp.int32)
  order, starts, ends, _, _ = segments(ids, num_embeddings)
  zeros = jnp.zeros(grads.shape, jnp.float32)
  (out,) = reduce_runs(grads, order, starts, ends, WriteRows(zeros, grads.shape[1]),
                       variant=variant, interpret=interpret)
  return out
