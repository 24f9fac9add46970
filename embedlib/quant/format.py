"""Quantized table storage: row-wise int8 / int4 with a scale and bias, fp8, bf16.

A `QuantizedTable` is a pytree that strategies carry exactly as they carry a
float table: its ``shape`` is the float table's (rows, columns) and its
``dtype`` is what lookups return (float32), so ``shard_map`` splits it with
the table's own ``PartitionSpec`` and only the kernels look inside.

Layout (FBGEMM's row-wise int8 / int4, per block of columns):

- the columns are ``blocks`` blocks of ``block_width`` each (one block per
  column shard of a hidden or grid layout, one block otherwise); each block
  of each row is quantized on its own, so a column shard's slice is a
  complete quantized table of its columns;
- ``data``: ``[rows, blocks * block_bytes]`` -- int8: ``uint8`` codes;
  int4: two codes a byte (column ``2j`` in the low nibble, ``2j + 1`` in the
  high one; an odd block width pads one zero nibble per block); fp8:
  ``float8_e4m3fn``; bf16: ``bfloat16``;
- ``scale_bias``: ``[rows, blocks, 2]`` in ``scale_dtype`` (fp16 or bf16),
  ``x ~ code * scale + bias``; fp8 stores ``[scale, 0]``; bf16 has none.

Error bounds, per element of a row block with values in ``[lo, hi]``
(``s`` the stored scale; ``u = 2**-23`` covers float32 arithmetic):

- int8 / int4: ``|x - x'| <= s / 2 + 4 u (|x| + |bias| + levels s)``, with
  ``s ~ (hi - lo) / levels`` (``levels`` 255 / 15). The bias is the block
  minimum rounded *down* to the scale dtype and the scale rounded *up*, so
  every value lies inside the codes' range and none is clamped;
- fp8 (e4m3, scale ``amax / 448`` rounded up): ``|x - x'| <= 2**-4 |x| +
  2**-10 s`` (3 mantissa bits; the second term is the subnormals' step);
- bf16: ``|x - x'| <= 2**-8 |x|``.

>>> import numpy as np
>>> t = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
>>> q = quantize_table(t, bits=8)
>>> q.shape, q.data.dtype.name, q.scale_bias.shape
((3, 4), 'uint8', (3, 1, 2))
>>> bool(np.abs(np.asarray(dequantize(q)) - t).max() < 0.01)
True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

INT8, INT4, FP8, BF16 = 8, 4, "fp8", "bf16"
#: The ``bits=`` values `quantize_table` takes.
FORMATS = (INT8, INT4, FP8, BF16)
#: Largest code of an integer format.
LEVELS = {INT8: 255, INT4: 15}
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_DTYPES = (jnp.float16, jnp.bfloat16)


def check_format(bits, scale_dtype=jnp.float16) -> None:
  """Raises ValueError unless ``bits`` is one of `FORMATS` and ``scale_dtype`` fp16 / bf16."""
  if bits not in FORMATS:
    raise ValueError(
        f"quantize: bits={bits!r} is not a table format; use one of {FORMATS} "
        "(8 and 4: row-wise integers with a scale and bias; 'fp8': float8_e4m3fn "
        "with a row scale; 'bf16': bfloat16 storage)."
    )
  if jnp.dtype(scale_dtype) not in tuple(map(jnp.dtype, SCALE_DTYPES)):
    raise ValueError(
        f"quantize: scale_dtype={jnp.dtype(scale_dtype).name} is not supported; "
        "use jnp.float16 or jnp.bfloat16."
    )


def block_bytes(bits, block_width: int) -> int:
  """Entries of ``data`` per row block: bytes for int4 (two codes a byte), elements otherwise."""
  return (block_width + 1) // 2 if bits == INT4 else block_width


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTable:
  """A quantized ``[rows, blocks * block_width]`` table (see the module docstring).

  Attributes:
    data: ``[rows, blocks * block_bytes(bits, block_width)]`` codes.
    scale_bias: ``[rows, blocks, 2]`` in the scale dtype, or None (bf16).
    bits: one of `FORMATS`.
    block_width: columns per block (a column shard's width).
  """

  data: jax.Array
  scale_bias: jax.Array | None
  bits: int | str = dataclasses.field(metadata=dict(static=True))
  block_width: int = dataclasses.field(metadata=dict(static=True))

  @property
  def blocks(self) -> int:
    return self.data.shape[1] // block_bytes(self.bits, self.block_width)

  @property
  def shape(self) -> tuple[int, int]:
    """The float table's ``(rows, columns)`` (of this shard, inside ``shard_map``)."""
    return (self.data.shape[0], self.blocks * self.block_width)

  @property
  def dtype(self):
    """What lookups return: float32."""
    return jnp.dtype(jnp.float32)

  @property
  def ndim(self) -> int:
    return 2

  @property
  def nbytes(self) -> int:
    """Bytes stored (codes, scales and biases)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(self))


def is_quantized(table) -> bool:
  return isinstance(table, QuantizedTable)


def _round_to(x, dtype, down: bool):
  """``x`` (float32) in ``dtype``, rounded toward -inf (``down``) or +inf."""
  y = x.astype(dtype)
  wrong = y.astype(jnp.float32) > x if down else y.astype(jnp.float32) < x
  step = jnp.nextafter(y, jnp.array(-jnp.inf if down else jnp.inf, dtype))
  return jnp.where(wrong, step, y)


def _quantize_blocks(x, bits, scale_dtype):
  """``x``: float32 ``[rows, blocks, width]`` -> (codes ``[rows, blocks, width]``, scale_bias)."""
  if bits == BF16:
    return x.astype(jnp.bfloat16), None
  if bits == FP8:
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = _round_to(amax / FP8_MAX, scale_dtype, down=False)
    s = scale.astype(jnp.float32)
    codes = jnp.where(s > 0, x / jnp.where(s > 0, s, 1.0), 0.0)
    codes = jnp.clip(codes, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return codes, jnp.concatenate([scale, jnp.zeros_like(scale)], axis=-1)
  levels = LEVELS[bits]
  lo = jnp.min(x, axis=-1, keepdims=True)
  hi = jnp.max(x, axis=-1, keepdims=True)
  bias = _round_to(lo, scale_dtype, down=True)
  b = bias.astype(jnp.float32)
  scale = _round_to((hi - b) / levels, scale_dtype, down=False)
  s = scale.astype(jnp.float32)
  codes = jnp.where(s > 0, jnp.round((x - b) / jnp.where(s > 0, s, 1.0)), 0.0)
  codes = jnp.clip(codes, 0, levels).astype(jnp.uint8)
  return codes, jnp.concatenate([scale, bias], axis=-1)


def _pack4(codes):
  """``[rows, blocks, width]`` uint8 codes < 16 -> ``[rows, blocks, ceil(width / 2)]`` bytes."""
  if codes.shape[-1] % 2:
    codes = jnp.pad(codes, [(0, 0), (0, 0), (0, 1)])
  return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack4(packed, width: int):
  """``[..., ceil(width / 2)]`` bytes -> ``[..., width]`` uint8 codes (inverse of the packing)."""
  both = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
  return both.reshape(packed.shape[:-1] + (-1,))[..., :width]


def quantize_table(table, bits=INT8, *, scale_dtype=jnp.float16, blocks: int = 1) -> QuantizedTable:
  """Quantizes a float ``[rows, columns]`` table row by row (per block of columns).

  Elementwise along rows, so a jitted call on a row-sharded table keeps
  each shard where it is.

  Args:
    table: float ``[rows, columns]``; ``columns`` divisible by ``blocks``.
    bits: one of `FORMATS`.
    scale_dtype: ``jnp.float16`` or ``jnp.bfloat16``.
    blocks: column blocks quantized separately (a hidden or grid layout's
      column shards).

  Returns:
    A `QuantizedTable` of ``table``'s shape.
  """
  check_format(bits, scale_dtype)
  table = jnp.asarray(table, jnp.float32)
  rows, columns = table.shape
  if columns % blocks:
    raise ValueError(
        f"quantize: {columns} columns do not split into {blocks} blocks; pass a "
        "divisor of the width (the column shards of the layout)."
    )
  width = columns // blocks
  codes, scale_bias = _quantize_blocks(table.reshape(rows, blocks, width), bits, scale_dtype)
  if bits == INT4:
    codes = _pack4(codes)
  return QuantizedTable(codes.reshape(rows, -1), scale_bias, bits, width)


def dequantize_rows(data, scale_bias, bits, block_width: int):
  """Float32 rows from their codes: ``[n, blocks * block_bytes]`` -> ``[n, blocks * block_width]``.

  The one dequantizing formula: every kernel computes ``code * scale + bias``
  in float32 in this order, so all give the same bits.
  """
  n = data.shape[0]
  per = block_bytes(bits, block_width)
  blocks = data.shape[1] // per
  codes = data.reshape(n, blocks, per)
  if bits == INT4:
    codes = unpack4(codes, block_width)
  codes = codes.astype(jnp.float32)
  if scale_bias is None:
    return codes.reshape(n, blocks * block_width)
  sb = scale_bias.astype(jnp.float32)
  out = codes * sb[..., 0:1] + sb[..., 1:2]
  return out.reshape(n, blocks * block_width)


def dequantize(table: QuantizedTable) -> jax.Array:
  """The whole float32 table (tests and checks only: lookups never build it)."""
  return dequantize_rows(table.data, table.scale_bias, table.bits, table.block_width)


# -- numpy reference (tests check the jnp code against it) ----------------


def reference_dequantize(table: QuantizedTable) -> np.ndarray:
  """``dequantize`` in numpy, from the stored bytes alone."""
  data = np.asarray(table.data)
  rows = data.shape[0]
  width, per = table.block_width, block_bytes(table.bits, table.block_width)
  codes = data.reshape(rows, -1, per)
  if table.bits == INT4:
    codes = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(rows, codes.shape[1], -1)
    codes = codes[..., :width]
  codes = codes.astype(np.float32)
  if table.scale_bias is None:
    return codes.reshape(rows, -1)
  sb = np.asarray(table.scale_bias).astype(np.float32)
  return (codes * sb[..., :1] + sb[..., 1:]).reshape(rows, -1)


def error_bound(table, quantized: QuantizedTable) -> np.ndarray:
  """The per-element bound on ``|table - dequantize(quantized)|`` the module docstring states."""
  x = np.asarray(table, np.float32)
  rows = x.shape[0]
  blocks = quantized.blocks
  x3 = np.abs(x.reshape(rows, blocks, -1))
  u = 2.0 ** -23
  if quantized.bits == BF16:
    return (2.0 ** -8 * x3).reshape(rows, -1)
  sb = np.asarray(quantized.scale_bias).astype(np.float32)
  s, b = sb[..., :1], sb[..., 1:]
  if quantized.bits == FP8:
    return (2.0 ** -4 * x3 + 2.0 ** -10 * s).reshape(rows, -1)
  levels = LEVELS[quantized.bits]
  bound = s / 2 + 4 * u * (x3 + np.abs(b) + levels * s)
  return bound.reshape(rows, -1)
