"""Triton pooled bag with many rows in flight: ``pooled[b] = sum_l coef[b, l] * table[ids[b, l]]``.

One program per ``variant.bags`` bags. Each step of its loop requests
``variant.unroll`` slots of every bag at once: one ``[bags x unroll, chunk]``
tile per column chunk, so that even a few bags of short rows (a bf16 row of
64 is 128 bytes) spread over every lane of the program with 16-byte loads
(``bags x unroll`` rows of 128 bytes: 8 lanes a row). The step's slots of
each bag are then summed across the lanes that hold them and added to the
bag's float32 accumulator (the reference's terms, summed in another order).
The ``[batch, bag, features]`` rows are never written: only the pooled
``[batch, features]``. A bag's ragged last step and invalid ids are masked
loads (no memory request).

The combiner's denominator (the sum of the valid weights, or the root of
their squares' sum) is summed in the same loop and divides the sums at the
end, as `bag_pallas` does: no coefficient array is made outside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from embedlib.kernels import bags
from embedlib.kernels import rows as rows_lib
from embedlib.kernels.rows import BagVariant
from embedlib.sharding import match_varying, out_struct


class FloatRows:
  """Reads a float table's rows: one float32 tile per column chunk (`rows.column_chunks`).

  A reader has ``chunks``, the ``(first column, width)`` of the output's
  column chunks, and ``read(table_refs, ids, valid)``, the tiles of those
  chunks for rows ``ids`` (zeros where not ``valid``).
  """

  def __init__(self, features: int):
    self.chunks = rows_lib.column_chunks(features)

  def read(self, table_refs, ids, valid):
    (table_ref,) = table_refs
    return [rows_lib.load(table_ref, ids, rows_lib.iota(width, c0), valid).astype(jnp.float32)
            for c0, width in self.chunks]


def _bag_kernel(*refs, batch, bag, num_embeddings, block, unroll, combiner, weighted, reader,
                tables):
  ids_ref, refs = refs[0], refs[1:]
  w_ref = None
  if weighted:
    w_ref, refs = refs[0], refs[1:]
  table_refs, out_ref = refs[:tables], refs[tables]
  bags = rows_lib.iota(block, pl.program_id(0) * block)
  inside = bags < batch

  # One tile per step: ``unroll`` slots of each of the ``block`` bags, bag-major.
  lane = rows_lib.iota(block * unroll)
  lane_bag = pl.program_id(0) * block + lane // unroll
  lane_inside = lane_bag < batch

  def step(s, carry):
    accs, wsum, w2sum = carry
    slot = s * unroll + lane % unroll
    flat = lane_bag * bag + jnp.minimum(slot, bag - 1)
    taken = lane_inside & (slot < bag)
    ids = rows_lib.load_vector(ids_ref, flat, taken, other=-1)
    valid = taken & (ids >= 0) & (ids < num_embeddings)
    w = (rows_lib.load_vector(w_ref, flat, valid, other=0.0) if weighted
         else valid.astype(jnp.float32))
    tiles = reader.read(table_refs, ids, valid)
    # Each bag's slots of the step summed (a reduction across the lanes that
    # hold them), then added to the bag's accumulator.
    accs = [acc + (w[:, None] * vals if weighted else vals).reshape(block, unroll, -1).sum(1)
            for acc, vals in zip(accs, tiles)]
    w = w.reshape(block, unroll)
    return accs, wsum + w.sum(1), w2sum + (w * w).sum(1)

  zeros = jnp.zeros((block,), jnp.float32)
  carry = ([jnp.zeros((block, width), jnp.float32) for _, width in reader.chunks], zeros, zeros)
  steps = pl.cdiv(bag, unroll)
  accs, wsum, w2sum = step(0, carry) if steps == 1 else jax.lax.fori_loop(0, steps, step, carry)
  if combiner != "sum":
    denom = wsum if combiner == "mean" else jnp.sqrt(w2sum)
    scale = jnp.where(denom == 0, 0.0, 1.0 / jnp.where(denom == 0, 1.0, denom))
    accs = [acc * scale[:, None] for acc in accs]
  for (c0, width), acc in zip(reader.chunks, accs):
    rows_lib.store(out_ref, bags, rows_lib.iota(width, c0), acc, inside)


def bag_rows(table: jax.Array, ids: jax.Array, weights: jax.Array | None = None, *,
             combiner: str = "sum", variant: BagVariant = BagVariant(),
             interpret: bool = False) -> jax.Array:
  """Pooled bag lookup as a Triton Pallas kernel, ``bags x unroll`` rows in flight per program.

  Equivalent JAX code (`embedlib.kernels.bag_reference`)::

    valid = (ids >= 0) & (ids < table.shape[0])
    w = jnp.where(valid, 1.0 if weights is None else weights, 0.0)
    denom = {"sum": 1, "mean": w.sum(-1), "sqrtn": sqrt((w * w).sum(-1))}[combiner]
    rows = gather_reference(table, ids)                          # zeros for invalid ids
    pooled = sum(w[:, l, None] * rows[:, l] for l in range(bag)) / denom   # 0 where denom == 0

  Not differentiable by itself: `rows_ad.bag` wraps it.

  Args:
    table: ``[num_embeddings, features]``, any float dtype.
    ids: int ``[batch, bag]``; ids outside ``[0, num_embeddings)`` are padding.
    weights: optional float ``[batch, bag]``.
    combiner: ``"sum"``, ``"mean"`` or ``"sqrtn"``.
    variant: bags per program, slots per step and warps.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    ``[batch, features]`` in ``table.dtype`` (accumulated in float32).

  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> bag_rows(table, jnp.array([[0, 2, -1]]), combiner="mean", interpret=True).tolist()
  [[2.0, 3.0]]
  """
  bags.check_combiner(combiner)
  num_embeddings, features = table.shape
  batch, bag = ids.shape
  if batch == 0 or bag == 0 or num_embeddings == 0 or features == 0:
    return jnp.zeros((batch, features), table.dtype)
  return pooled(FloatRows(features), [table], ids, weights, combiner=combiner,
                num_embeddings=num_embeddings, features=features, out_dtype=table.dtype,
                variant=variant, interpret=interpret, name="embedlib_bag_rows")


def pooled(reader, tables, ids, weights, *, combiner, num_embeddings, features, out_dtype,
           variant, interpret, name):
  """The bag kernel on any row format: ``reader`` turns ``tables``' refs into float32 tiles.

  Args:
    reader: reads ``tables``' rows as float32 tiles of the output's column
      chunks (`FloatRows`; ``embedlib.quant.bag_rows`` for quantized rows).
    tables: the arrays whose refs ``reader`` reads.
    ids, weights, combiner: as in `bag_rows` (``ids`` ``[batch, bag]``).
    num_embeddings, features: the table's logical shape.
    out_dtype: the result's dtype.
    variant, interpret: as in `bag_rows`.
    name: the kernel's name.

  Returns:
    ``[batch, features]`` in ``out_dtype``.
  """
  batch, bag = ids.shape
  operands = [ids.reshape(-1).astype(jnp.int32)]
  if weights is not None:
    operands.append(weights.reshape(-1).astype(jnp.float32))
  block = min(variant.bags, rows_lib.pow2(batch))
  kernel = functools.partial(
      _bag_kernel, batch=batch, bag=bag, num_embeddings=num_embeddings, block=block,
      unroll=min(rows_lib.pow2(variant.unroll), rows_lib.pow2(bag)), combiner=combiner,
      weighted=weights is not None,
      reader=reader, tables=len(tables))
  operands = match_varying(*operands, *tables)
  return pl.pallas_call(
      kernel,
      out_shape=out_struct((batch, features), out_dtype, *operands),
      grid=(pl.cdiv(batch, block),),
      compiler_params=rows_lib.compiler_params(variant.warps),
      interpret=interpret,
      name=name,
  )(*operands)
