"""Pallas (Triton) row gather: ``rows[i] = table[ids[i]]``, zero rows for invalid ids.

The table and the output stay in global memory as whole refs (no BlockSpecs):
each program reads a block of ids and gathers those rows with pointer
arithmetic, which is the memory-bound optimum for a lookup. Triton tiles must
have power-of-two sizes, so the feature lanes are rounded up to a power of
two and the extra lanes are *clamped* onto the last real column rather than
masked: they re-read and re-write the same element with the same value. That
keeps the kernel free of ``pltriton.load(mask=...)``, which does not run in
interpret mode, so the code tested on CPU is the code lowered for CUDA. The
same trick covers a ragged last block of ids (clamped onto the last id).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from embedlib.sharding import match_varying, out_struct

#: Elements of one program's tile (ids per block x padded features); large
#: enough to keep many row reads in flight, small enough for registers.
TILE_ELEMENTS = 4096


def next_pow2(n: int) -> int:
  """Smallest power of two >= ``n`` (and >= 1).

  >>> [next_pow2(n) for n in (1, 3, 64, 100)]
  [1, 4, 64, 128]
  """
  return 1 << max(int(n) - 1, 0).bit_length()


def lane_columns(features: int) -> jax.Array:
  """Column index of each of the ``next_pow2(features)`` lanes, clamped to the last column."""
  return jnp.minimum(jnp.arange(next_pow2(features), dtype=jnp.int32), features - 1)


def block_ids(n: int, features: int) -> int:
  """Ids per program: a power of two so that a tile is about `TILE_ELEMENTS`."""
  per_block = max(TILE_ELEMENTS // next_pow2(features), 1)
  return min(per_block, next_pow2(n))


def compiler_params(num_warps: int = 4, num_stages: int = 1):
  """Triton compiler parameters (ignored in interpret mode)."""
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _gather_kernel(ids_ref, table_ref, out_ref, *, n, num_embeddings, features, block):
  start = pl.program_id(0) * block
  # Lanes past the last id re-do the last id: an identical, harmless write.
  pos = jnp.minimum(start + jnp.arange(block, dtype=jnp.int32), n - 1)
  ids = ids_ref[pos]
  valid = (ids >= 0) & (ids < num_embeddings)
  row = jnp.clip(ids, 0, num_embeddings - 1)
  cols = lane_columns(features)
  rows2d = jnp.broadcast_to(row[:, None], (block, cols.shape[0]))
  cols2d = jnp.broadcast_to(cols[None, :], (block, cols.shape[0]))
  vals = table_ref[rows2d, cols2d]
  vals = jnp.where(valid[:, None], vals, jnp.zeros((), vals.dtype))
  pos2d = jnp.broadcast_to(pos[:, None], (block, cols.shape[0]))
  out_ref[pos2d, cols2d] = vals


def gather_pallas(table: jax.Array, ids: jax.Array, *, interpret: bool = False) -> jax.Array:
  """Row gather as a Triton Pallas kernel.

  Equivalent JAX code (`embedlib.kernels.gather_reference`)::

    valid = (ids >= 0) & (ids < table.shape[0])
    rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0)
    rows = jnp.where(valid[..., None], rows, 0)

  Not differentiable by itself (a ``pallas_call`` has no autodiff): use
  `embedlib.kernels.gather`, which wraps it in a ``custom_vjp``.

  Args:
    table: ``[num_embeddings, features]``, any float dtype.
    ids: int array of any shape.
    interpret: run the kernel in the Pallas interpreter (CPU tests).

  Returns:
    ``ids.shape + (features,)`` in ``table.dtype``.

  >>> import jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> gather_pallas(table, jnp.array([2, -1, 0]), interpret=True).tolist()
  [[4.0, 5.0], [0.0, 0.0], [0.0, 1.0]]
  """
  num_embeddings, features = table.shape
  flat = ids.reshape(-1).astype(jnp.int32)
  n = flat.shape[0]
  if n == 0 or num_embeddings == 0 or features == 0:
    return jnp.zeros(ids.shape + (features,), table.dtype)
  block = block_ids(n, features)
  kernel = functools.partial(
      _gather_kernel, n=n, num_embeddings=num_embeddings, features=features, block=block
  )
  flat, table = match_varying(flat, table)
  out = pl.pallas_call(
      kernel,
      out_shape=out_struct((n, features), table.dtype, flat, table),
      grid=(pl.cdiv(n, block),),
      compiler_params=compiler_params(),
      interpret=interpret,
      name="embedlib_gather",
  )(flat, table)
  return out.reshape(ids.shape + (features,))
