"""Pallas (Triton) gather and bag of a `QuantizedTable`, dequantizing each row as it is read.

The float kernels' designs (`kernels.gather_pallas`, `kernels.bag_pallas`:
whole refs, clamped lanes, one ``[block, lanes]`` tile per program) with
one change: a lane reads its code (a byte, a nibble of a byte, an fp8 or a
bf16) and its row block's scale and bias, and computes ``code * scale +
bias`` in float32, the formula of `format.dequantize_rows`. Only the rows
looked up are ever dequantized, in registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from embedlib.kernels.bag_pallas import block_bags
from embedlib.kernels.gather_pallas import block_ids, compiler_params, lane_columns
from embedlib.quant import format as fmt
from embedlib.sharding import match_varying, out_struct


def _lanes(table: fmt.QuantizedTable):
  """Per lane: (code column, nibble shift, scale column) of a ``[rows, columns]`` lane map."""
  width = table.block_width
  cols = lane_columns(table.shape[1])
  block, j = cols // width, cols % width
  per = fmt.block_bytes(table.bits, width)
  if table.bits == fmt.INT4:
    return block * per + j // 2, (j % 2) * 4, block * 2
  return block * per + j, None, block * 2


def _load(refs, rows, lanes, table):
  """Float32 ``[block, lanes]`` of rows ``rows`` (``[block]``, in range)."""
  data_ref, sb_ref = refs
  code_col, shift, sb_col = lanes
  shape = (rows.shape[0], code_col.shape[0])
  rows2d = jnp.broadcast_to(rows[:, None], shape)
  codes = data_ref[rows2d, jnp.broadcast_to(code_col[None, :], shape)]
  if shift is not None:
    codes = (codes.astype(jnp.int32) >> jnp.broadcast_to(shift[None, :], shape)) & 0xF
  codes = codes.astype(jnp.float32)
  if sb_ref is None:
    return codes
  sb_col2d = jnp.broadcast_to(sb_col[None, :], shape)
  scale = sb_ref[rows2d, sb_col2d].astype(jnp.float32)
  bias = sb_ref[rows2d, sb_col2d + 1].astype(jnp.float32)
  return codes * scale + bias


def _operands(table: fmt.QuantizedTable):
  """The kernel's table refs: codes, and the scales and biases as ``[rows, blocks * 2]``."""
  if table.scale_bias is None:
    return [table.data]
  return [table.data, table.scale_bias.reshape(table.data.shape[0], -1)]


def _gather_kernel(ids_ref, *refs, n, table, block):
  *tables, out_ref = refs
  tables = tables if len(tables) == 2 else tables + [None]
  start = pl.program_id(0) * block
  pos = jnp.minimum(start + jnp.arange(block, dtype=jnp.int32), n - 1)
  ids = ids_ref[pos]
  rows = table.shape[0]
  valid = (ids >= 0) & (ids < rows)
  vals = _load(tables, jnp.clip(ids, 0, rows - 1), _lanes(table), table)
  vals = jnp.where(valid[:, None], vals, 0.0)
  cols = lane_columns(table.shape[1])
  shape = vals.shape
  out_ref[jnp.broadcast_to(pos[:, None], shape), jnp.broadcast_to(cols[None, :], shape)] = vals


def gather_triton(table: fmt.QuantizedTable, ids: jax.Array, *, interpret: bool = False):
  """``dequantize(table)[ids]`` (zero rows for invalid ids) without dequantizing the table.

  Equivalent JAX code: `lookup.gather` with ``kernel="xla"``.

  Args:
    table: a `QuantizedTable` (a local shard inside ``shard_map``).
    ids: int array of any shape.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    float32 ``ids.shape + (columns,)``.
  """
  rows, features = table.shape
  flat = ids.reshape(-1).astype(jnp.int32)
  n = flat.shape[0]
  if n == 0 or rows == 0:
    return jnp.zeros(ids.shape + (features,), jnp.float32)
  block = block_ids(n, features)
  # The QuantizedTable is static here: only its shapes and format are read.
  static = fmt.QuantizedTable(jax.ShapeDtypeStruct(table.data.shape, table.data.dtype), None,
                              table.bits, table.block_width)
  kernel = functools.partial(_gather_kernel, n=n, table=static, block=block)
  operands = match_varying(flat, *_operands(table))
  out = pl.pallas_call(
      kernel,
      out_shape=out_struct((n, features), jnp.float32, *operands),
      grid=(pl.cdiv(n, block),),
      compiler_params=compiler_params(),
      interpret=interpret,
      name="embedlib_quantized_gather",
  )(*operands)
  return out.reshape(ids.shape + (features,))


def _bag_kernel(*refs, batch, bag, table, block, combiner, weighted, scaled):
  ids_ref, *refs = refs
  w_ref = None
  if weighted:
    w_ref, *refs = refs
  data_ref, *refs = refs
  sb_ref = refs[0] if scaled else None
  out_ref = refs[-1]
  rows = table.shape[0]
  start = pl.program_id(0) * block
  bags = jnp.minimum(start + jnp.arange(block, dtype=jnp.int32), batch - 1)
  lanes = _lanes(table)
  cols = lane_columns(table.shape[1])

  def body(slot, carry):
    acc, wsum, w2sum = carry
    flat = bags * bag + slot
    ids = ids_ref[flat]
    valid = (ids >= 0) & (ids < rows)
    w = w_ref[flat] if weighted else jnp.ones((block,), jnp.float32)
    w = jnp.where(valid, w, 0.0)
    vals = _load((data_ref, sb_ref), jnp.clip(ids, 0, rows - 1), lanes, table)
    return acc + w[:, None] * vals, wsum + w, w2sum + w * w

  zeros = jnp.zeros((block,), jnp.float32)
  acc, wsum, w2sum = jax.lax.fori_loop(
      0, bag, body, (jnp.zeros((block, cols.shape[0]), jnp.float32), zeros, zeros))
  if combiner != "sum":
    denom = wsum if combiner == "mean" else jnp.sqrt(w2sum)
    scale = jnp.where(denom == 0, 0.0, 1.0 / jnp.where(denom == 0, 1.0, denom))
    acc = acc * scale[:, None]
  shape = acc.shape
  out_ref[jnp.broadcast_to(bags[:, None], shape), jnp.broadcast_to(cols[None, :], shape)] = acc


def bag_triton(table: fmt.QuantizedTable, ids, weights=None, *, combiner="sum",
               interpret: bool = False):
  """Pooled bags of a `QuantizedTable`, each row dequantized in the accumulating loop.

  Equivalent JAX code: `kernels.bag_pallas` on ``dequantize(table)``.

  Args:
    table: a `QuantizedTable`.
    ids: int ``[batch, bag]``, any id outside ``[0, rows)`` padding.
    weights: optional float ``[batch, bag]``.
    combiner: ``"sum" | "mean" | "sqrtn"``.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    float32 ``[batch, columns]``.
  """
  rows, features = table.shape
  batch, bag = ids.shape
  if batch == 0 or bag == 0 or rows == 0:
    return jnp.zeros((batch, features), jnp.float32)
  block = block_bags(batch, features)
  static = fmt.QuantizedTable(jax.ShapeDtypeStruct(table.data.shape, table.data.dtype), None,
                              table.bits, table.block_width)
  kernel = functools.partial(
      _bag_kernel, batch=batch, bag=bag, table=static, block=block, combiner=combiner,
      weighted=weights is not None, scaled=table.scale_bias is not None)
  operands = [ids.reshape(-1).astype(jnp.int32)]
  if weights is not None:
    operands.append(weights.reshape(-1).astype(jnp.float32))
  operands = match_varying(*operands, *_operands(table))
  return pl.pallas_call(
      kernel,
      out_shape=out_struct((batch, features), jnp.float32, *operands),
      grid=(pl.cdiv(batch, block),),
      compiler_params=compiler_params(num_stages=2),
      interpret=interpret,
      name="embedlib_quantized_bag",
  )(*operands)
