"""Triton row gather with many rows in flight: ``rows[i] = table[ids[i]]``, zero rows for invalid ids.

One program per ``variant.rows`` ids: it loads their ids, then requests
all their rows at once as one ``[rows, chunk]`` tile per column chunk
(`rows.column_chunks`) and stores the tile to the output. An invalid id's
row is a masked load (no memory request, zeros); the ids past the end of
a ragged last block are masked loads and stores. See `rows` for why the
tile gives 16-byte accesses and a full grid.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from embedlib.kernels import rows as rows_lib
from embedlib.kernels.rows import GatherVariant
from embedlib.sharding import match_varying, out_struct


def _gather_kernel(ids_ref, table_ref, out_ref, *, n, num_embeddings, features, block):
  pos = rows_lib.iota(block, pl.program_id(0) * block)
  inside = pos < n
  ids = rows_lib.load_vector(ids_ref, pos, inside, other=-1)
  valid = (ids >= 0) & (ids < num_embeddings)
  for c0, width in rows_lib.column_chunks(features):
    cols = rows_lib.iota(width, c0)
    vals = rows_lib.load(table_ref, ids, cols, valid)
    rows_lib.store(out_ref, pos, cols, vals, inside)


def supports(table_shape, dtype) -> bool:
  """Whether the kernel takes a ``[rows, features]`` table of ``dtype``: any float, int32 rows.

  >>> supports((10, 3), jnp.bfloat16), supports((10, 3), jnp.int32)
  (True, False)
  """
  rows, features = table_shape
  return jnp.issubdtype(dtype, jnp.floating) and 0 < features and rows < 2**31


def gather_rows(table: jax.Array, ids: jax.Array, *, variant: GatherVariant = GatherVariant(),
                interpret: bool = False) -> jax.Array:
  """Row gather as a Triton Pallas kernel, ``variant.rows`` rows in flight per program.

  Equivalent JAX code (`embedlib.kernels.gather_reference`)::

    valid = (ids >= 0) & (ids < table.shape[0])
    rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0)
    rows = jnp.where(valid[..., None], rows, 0)

  Not differentiable by itself: `rows_ad.gather` wraps it in a
  ``custom_vjp``.

  Args:
    table: ``[num_embeddings, features]``, any float dtype.
    ids: int array of any shape.
    variant: rows per program and warps.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    ``ids.shape + (features,)`` in ``table.dtype``.

  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> gather_rows(table, jnp.array([2, -1, 0]), interpret=True).tolist()
  [[4.0, 5.0], [0.0, 0.0], [0.0, 1.0]]
  """
  num_embeddings, features = table.shape
  flat = ids.reshape(-1).astype(jnp.int32)
  n = flat.shape[0]
  if n == 0 or num_embeddings == 0 or features == 0:
    return jnp.zeros(ids.shape + (features,), table.dtype)
  block = min(variant.rows, rows_lib.pow2(n))
  kernel = functools.partial(_gather_kernel, n=n, num_embeddings=num_embeddings,
                             features=features, block=block)
  flat, table = match_varying(flat, table)
  out = pl.pallas_call(
      kernel,
      out_shape=out_struct((n, features), table.dtype, flat, table),
      grid=(pl.cdiv(n, block),),
      compiler_params=rows_lib.compiler_params(variant.warps),
      interpret=interpret,
      name="embedlib_gather_rows",
  )(flat, table)
  return out.reshape(ids.shape + (features,))
