"""Quantize / dequantize of each format against numpy, and the stated error bounds."""

import jax.numpy as jnp
import numpy as np
import pytest

from embedlib.quant import format as fmt


def _table(rows=9, cols=12, seed=0):
  rng = np.random.default_rng(seed)
  t = rng.normal(size=(rows, cols)).astype(np.float32) * rng.uniform(0.01, 30, (rows, 1))
  t[0] = 0.0  # a constant row: a zero scale
  t[1] = 3.25  # a constant row that fp16 holds exactly
  t[2, :] = np.linspace(-1e-3, 1e-3, cols)  # a narrow range
  return t


@pytest.mark.parametrize("bits", fmt.FORMATS)
@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.bfloat16])
def test_error_within_bound(bits, blocks, scale_dtype):
  t = _table()
  q = fmt.quantize_table(t, bits, scale_dtype=scale_dtype, blocks=blocks)
  out = np.asarray(fmt.dequantize(q))
  np.testing.assert_array_equal(out, fmt.reference_dequantize(q))
  err = np.abs(out - t)
  assert (err <= fmt.error_bound(t, q)).all(), err.max()
  assert q.shape == t.shape and q.blocks == blocks


def test_int_bound_is_half_a_step():
  # The bound the docstring states, from the values alone: (max - min) / levels
  # per block, over half, up to the scale dtype's rounding.
  t = _table()
  for bits, levels in fmt.LEVELS.items():
    q = fmt.quantize_table(t, bits)
    step = (t.max(1) - t.min(1)) / levels
    err = np.abs(np.asarray(fmt.dequantize(q)) - t).max(1)
    assert (err <= step / 2 * (1 + 2**-9) + 1e-6 * np.abs(t).max(1) + 1e-7).all()


def test_storage_and_packing():
  t = np.arange(10, dtype=np.float32).reshape(2, 5)  # odd block width: a pad nibble
  q = fmt.quantize_table(t, 4)
  assert q.data.shape == (2, 3) and q.data.dtype == jnp.uint8
  assert q.scale_bias.shape == (2, 1, 2) and q.scale_bias.dtype == jnp.float16
  # codes 0, 4, 8, 11, 15 of row 0 (scale 4/15 rounded up): low nibble first
  codes = np.asarray(fmt.unpack4(q.data, 5))
  assert codes[0, 0] == 0 and codes[0, -1] == 15
  assert np.asarray(q.data)[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
  assert fmt.quantize_table(t, 8).nbytes == 2 * 5 + 2 * 4
  assert fmt.quantize_table(t, "bf16").scale_bias is None
  assert fmt.quantize_table(t, "fp8").data.dtype == jnp.float8_e4m3fn


def test_bad_format():
  with pytest.raises(ValueError, match="bits=3"):
    fmt.quantize_table(np.zeros((2, 2)), 3)
  with pytest.raises(ValueError, match="float32"):
    fmt.quantize_table(np.zeros((2, 2)), 8, scale_dtype=jnp.float32)
