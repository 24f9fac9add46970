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


def _manual_axis_type(x):
  return getattr(jax.typeof(x), "manual_axis_type", None)


def match_varying(*operands) -> list:
  """Operands cast to vary over the union of their manual mesh axes.

  Inside ``jax.shard_map`` (``check_vma=True``) a ``pallas_call`` in
  interpret mode evaluates its body with ordinary primitives, which reject
  mixing, say, a vocab-sharded table with replicated ids. ``pcast`` only
  changes the type (no data moves); outside ``shard_map`` this is the identity.

  >>> import jax.numpy as jnp
  >>> len(match_varying(jnp.zeros(2), jnp.ones(3)))
  2
  """
  mats = [_manual_axis_type(x) for x in operands]
  if any(m is None for m in mats):  # a jax without manual axis types
    return list(operands)
  union = frozenset().union(*(m.varying for m in mats))
  return [
      jax.lax.pcast(x, tuple(sorted(union - m.varying)), to="varying") if union - m.varying else x
      for x, m in zip(operands, mats)
  ]


def sum_to_varying_of(x: jax.Array, like: jax.Array) -> jax.Array:
  """``psum`` of ``x`` over the manual axes it varies over and ``like`` does not.

  A custom_vjp backward must return a cotangent typed like its primal. A table
  replicated over, say, the data axis but read with data-sharded ids was
  implicitly broadcast in the forward; the transpose of that broadcast is this
  sum (the data-parallel gradient reduction).

  >>> import jax.numpy as jnp
  >>> sum_to_varying_of(jnp.ones(2), jnp.zeros(3)).tolist()
  [1.0, 1.0]
  """
  mx, ml = _manual_axis_type(x), _manual_axis_type(like)
  if mx is None or ml is None:
    return x
  extra = tuple(sorted(mx.varying - ml.varying))
  return jax.lax.psum(x, extra) if extra else x


def out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
  """Output type of a ``pallas_call``, varying over every manual axis its operands vary over.

  Inside ``jax.shard_map`` (``check_vma=True``) a ``pallas_call`` cannot infer
  how its output varies across mesh axes and rejects a plain
  ``ShapeDtypeStruct``; outside it the set is empty and this is a plain one.

  >>> import jax.numpy as jnp
  >>> out_struct((2, 3), jnp.float32, jnp.zeros(4)).shape
  (2, 3)
  """
  mats = [_manual_axis_type(x) for x in operands]
  mats = [m for m in mats if m is not None]
  if not mats:
    return jax.ShapeDtypeStruct(shape, dtype)
  varying = frozenset().union(*(m.varying for m in mats))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))


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
