"""Bags and gathers of int8 / int4 `QuantizedTable` rows with many rows in flight (Triton).

The float bag of ``kernels/bag_rows.py`` with a reader of quantized rows: each
step requests the code bytes of ``bags x unroll`` rows (a ``[bags, chunk]``
byte tile per slot and byte chunk: a 128-wide int8 row is 8 threads' 16-byte
loads, an int4 row half that) and their row blocks' scales and biases, and
dequantizes in registers by `format.dequantize_rows`'s formula, ``code *
scale + bias`` in float32. An int4 byte holds columns ``2k`` and ``2k + 1``
(low nibble first) when the block width is even, so the two nibbles' values
are interleaved back into a contiguous tile of the output's columns. A gather
is a bag of one id per row.

Takes int8, and int4 of even block widths (`supports`); other formats keep
``quant/triton.py``'s kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedlib.kernels import bags
from embedlib.kernels import rows as rows_lib
from embedlib.kernels.bag_rows import pooled
from embedlib.kernels.rows import BagVariant, GatherVariant
from embedlib.quant import format as fmt


def supports(table: fmt.QuantizedTable) -> bool:
  """Whether these kernels take ``table``: int8, or int4 of an even block width.

  >>> import numpy as np
  >>> t = np.ones((4, 6), np.float32)
  >>> supports(fmt.quantize_table(t, bits=4)), supports(fmt.quantize_table(t, bits="fp8"))
  (True, False)
  """
  if table.bits == fmt.INT8:
    return True
  return table.bits == fmt.INT4 and table.block_width % 2 == 0


class QuantizedRows:
  """Reads a quantized table's rows as float32 tiles (the reader of `kernels.bag_rows.pooled`)."""

  def __init__(self, table: fmt.QuantizedTable):
    self.bits, self.width, self.blocks = table.bits, table.block_width, table.blocks
    self.nbytes = table.data.shape[1]
    self.byte_chunks = rows_lib.column_chunks(self.nbytes)
    per_byte = 2 if self.bits == fmt.INT4 else 1
    self.chunks = tuple((per_byte * c0, per_byte * w) for c0, w in self.byte_chunks)

  def _scale_bias(self, sb_ref, ids, valid, byte_cols):
    """Scale and bias of each byte's block: ``[b, 1]`` (one block), else ``[b, bytes]``."""
    if self.blocks == 1:
      cols = jnp.zeros((1,), jnp.int32)
    else:
      first_column = byte_cols * (2 if self.bits == fmt.INT4 else 1)
      cols = 2 * (first_column // self.width)
    scale = rows_lib.load(sb_ref, ids, cols, valid).astype(jnp.float32)
    bias = rows_lib.load(sb_ref, ids, cols + 1, valid).astype(jnp.float32)
    return scale, bias

  def read(self, table_refs, ids, valid):
    data_ref, sb_ref = table_refs
    tiles = []
    for c0, width in self.byte_chunks:
      byte_cols = rows_lib.iota(width, c0)
      codes = rows_lib.load(data_ref, ids, byte_cols, valid).astype(jnp.int32)
      scale, bias = self._scale_bias(sb_ref, ids, valid, byte_cols)
      if self.bits == fmt.INT8:
        tiles.append(codes.astype(jnp.float32) * scale + bias)
        continue
      # A byte's two columns share its block (the width is even), so its scale.
      lo = (codes & 0xF).astype(jnp.float32) * scale + bias
      hi = (codes >> 4).astype(jnp.float32) * scale + bias
      tiles.append(jnp.stack([lo, hi], axis=-1).reshape(lo.shape[0], 2 * width))
    return tiles


def _tables(table: fmt.QuantizedTable):
  return [table.data, table.scale_bias.reshape(table.data.shape[0], -1)]


def bag_rows(table: fmt.QuantizedTable, ids, weights=None, *, combiner: str = "sum",
             variant: BagVariant = BagVariant(), interpret: bool = False):
  """Pooled bags of ``dequantize(table)``, dequantizing only their rows, in registers.

  Equivalent JAX code: `kernels.bag_reference` on `format.dequantize` of the
  table (the rows of `lookup.bag` with ``kernel="xla"``).

  Args:
    table: an int8 or int4 `QuantizedTable` (`supports`).
    ids: int ``[batch, bag]``; any id outside ``[0, rows)`` is padding.
    weights: optional float ``[batch, bag]``.
    combiner: ``"sum"``, ``"mean"`` or ``"sqrtn"``.
    variant: bags per program, slots per step and warps.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    float32 ``[batch, columns]``.

  >>> import numpy as np
  >>> q = fmt.quantize_table(np.arange(8.0).reshape(4, 2), bits=4)
  >>> bag_rows(q, jnp.array([[0, 3, -1]]), combiner="mean", interpret=True).tolist()
  [[3.0, 4.0]]
  """
  bags.check_combiner(combiner)
  rows, features = table.shape
  batch, bag = ids.shape
  if batch == 0 or bag == 0 or rows == 0:
    return jnp.zeros((batch, features), jnp.float32)
  return pooled(QuantizedRows(table), _tables(table), ids, weights, combiner=combiner,
                num_embeddings=rows, features=features, out_dtype=jnp.float32, variant=variant,
                interpret=interpret, name="embedlib_quantized_bag_rows")


def gather_rows(table: fmt.QuantizedTable, ids, *, variant: GatherVariant = GatherVariant(),
                interpret: bool = False):
  """``dequantize(table)[ids]`` (zero rows for invalid ids), ``variant.rows`` rows a program.

  Equivalent JAX code: `lookup.gather` with ``kernel="xla"``.

  Args:
    table: an int8 or int4 `QuantizedTable` (`supports`).
    ids: int array of any shape.
    variant: rows per program and warps.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    float32 ``ids.shape + (columns,)``.
  """
  rows, features = table.shape
  flat = ids.reshape(-1, 1)
  if flat.shape[0] == 0 or rows == 0:
    return jnp.zeros(ids.shape + (features,), jnp.float32)
  out = pooled(QuantizedRows(table), _tables(table), flat, None, combiner="sum",
               num_embeddings=rows, features=features, out_dtype=jnp.float32,
               variant=BagVariant(variant.rows, 1, variant.warps), interpret=interpret,
               name="embedlib_quantized_gather_rows")
  return out.reshape(ids.shape + (features,))
