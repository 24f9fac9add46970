"""Quantized tables for inference: row-wise int8 / int4, fp8 and bf16 storage.

`quantize` turns a trained ``ShardedEmbed``, ``EmbeddingCollection`` or
model into one whose lookups read quantized rows and dequantize them inside
the gather and bag kernels (`lookup`), and whose tied logits (``attend``)
are scored from the codes (`scores`); `format` holds the storage and its
error bounds.
"""

from embedlib.quant.format import FORMATS, QuantizedTable, dequantize, quantize_table
from embedlib.quant.module import QuantizedEmbed, quantize

__all__ = ["FORMATS", "QuantizedEmbed", "QuantizedTable", "dequantize", "quantize", "quantize_table"]
