"""``query @ dequantize(table).T`` of a `QuantizedTable` shard, never forming a dequantized row.

The local product of a quantized table's ``attend`` (``strategies.attend``'s
``scores=``), the tied output layer of a next-item model. Each row block's
values are ``code * s + b`` (`format.dequantize_rows`, ``s`` and ``b`` that
row block's scale and bias), so its share of a logit is

    q_b . (c_b * s + b)  =  s * (q_b . c_b)  +  b * sum(q_b)

one product of the query with the codes, scaled per row, plus the bias
times the query's sum over the block. fp8 has no bias (``s * (q_b .
c_b)``), bf16 no scale (``q . c``). The codes enter the product as float32
operands (integers to 255, fp8 and bf16 values: all exact); an int4 byte's
two codes are read in place, the low nibbles against the query's even
columns and the high ones against its odd columns, so the codes are never
interleaved either.

Against the float attend of the dequantized table (``q . fl(c * s + b)``,
summed in another order) a logit differs by float32 rounding only:

    |logit - float logit| <= 2 (F + 4) u  sum_j |q_j| (|c_j| s + |b|)

with ``u = 2**-24`` and ``F`` the row's columns; ``sum_j |q_j| (|c_j| s +
|b|)`` is at most ``|q| . (|x'| + 2 |b|)``, ``x'`` the dequantized row.
That is the float32 products' rounding (XLA:CPU). Where the default
precision of a float32 product rounds its operands to TF32 (GPUs), both
products round the query so, and the float one its dequantized rows too,
while the codes are exact in TF32 (at most 8 significant bits).

>>> import numpy as np
>>> from embedlib.quant import format as fmt
>>> t = fmt.quantize_table(np.arange(6.0).reshape(3, 2), bits=8)
>>> q = np.array([[1.0, -1.0]], np.float32)
>>> bool(np.allclose(scores(q, t), q @ np.asarray(fmt.dequantize(t)).T, atol=1e-5))
True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from embedlib import sharding as sharding_lib
from embedlib.quant import format as fmt

#: Float32 codes one step of `scores` converts at most (a chunk of rows).
CHUNK_BYTES = 1 << 24


def _code_product(query, codes, bits, width: int):
  """``query @ codes.T`` of one row block: ``[T, width]`` x ``[R, block_bytes]`` -> ``[T, R]``."""
  if bits != fmt.INT4:
    return query @ codes.astype(jnp.float32).T
  low = (codes & 0xF).astype(jnp.float32)
  high = (codes >> 4).astype(jnp.float32)
  even, odd = query[:, 0::2], query[:, 1::2]
  if odd.shape[1] < even.shape[1]:  # an odd width: the last byte's high nibble is padding
    odd = jnp.pad(odd, [(0, 0), (0, 1)])
  return even @ low.T + odd @ high.T


def _block_scores(query, table: fmt.QuantizedTable):
  """``[T, columns]`` x a table of ``R`` rows -> float32 ``[T, R]``: the formula above."""
  width, per = table.block_width, fmt.block_bytes(table.bits, table.block_width)
  out = None
  for b in range(table.blocks):
    q = query[:, b * width:(b + 1) * width]
    part = _code_product(q, table.data[:, b * per:(b + 1) * per], table.bits, width)
    if table.scale_bias is not None:  # bf16 has none: its codes are the values
      sb = table.scale_bias[:, b].astype(jnp.float32)  # [R, 2]
      part = part * sb[:, 0]
      if table.bits != fmt.FP8:  # fp8 stores a zero bias
        part = part + jnp.sum(q, axis=1, keepdims=True) * sb[:, 1]
    out = part if out is None else out + part
  return out


def _rows(table: fmt.QuantizedTable, start, size: int) -> fmt.QuantizedTable:
  """Rows ``start .. start + size`` of ``table`` (``start`` may be traced)."""
  cut = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis=0)
  return dataclasses.replace(table, data=cut(table.data), scale_bias=cut(table.scale_bias))


def scores(query, table: fmt.QuantizedTable, *, chunk_rows: int | None = None) -> jax.Array:
  """``query @ dequantize(table).T`` without dequantizing ``table``.

  The rows are scored ``chunk_rows`` at a time (default: as many as
  `CHUNK_BYTES` of float32 codes hold), so a large shard's codes are never
  all converted to float32 at once, whatever the compiler fuses.

  Args:
    query: float ``[..., columns]`` (a shard's columns, inside ``shard_map``).
    table: a `QuantizedTable` ``[rows, columns]`` (a shard of one).
    chunk_rows: rows scored at once.

  Returns:
    ``[..., rows]``, computed in float32 and returned in ``query``'s dtype.
  """
  rows, columns = table.shape
  if query.shape[-1] != columns:
    raise ValueError(f"quantized scores: a query of {query.shape[-1]} columns against a "
                     f"table of {columns}; pass the table's columns.")
  flat = query.reshape(-1, columns).astype(jnp.float32)
  chunk = chunk_rows or max(1, CHUNK_BYTES // (4 * columns))
  if rows <= chunk:
    out = _block_scores(flat, table)
  else:
    full = rows // chunk

    def body(i, out):
      part = _block_scores(flat, _rows(table, i * chunk, chunk))
      return lax.dynamic_update_slice_in_dim(out, part, i * chunk, axis=1)

    out = sharding_lib.match_varying(jnp.zeros((flat.shape[0], rows), jnp.float32), flat,
                                     *jax.tree.leaves(table))[0]
    out = lax.fori_loop(0, full, body, out)
    if rows % chunk:
      last = _block_scores(flat, _rows(table, full * chunk, rows - full * chunk))
      out = lax.dynamic_update_slice_in_dim(out, last, full * chunk, axis=1)
  return out.reshape(query.shape[:-1] + (rows,)).astype(query.dtype)
