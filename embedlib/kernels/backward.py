"""Deterministic backward of the lookups: row gradients -> table gradient.

``table_grad[r] = sum over ids[j] == r of coef[j] * grads[src[j]]``, with
invalid ids dropped. Atomic scatter-adds make this order-dependent (and
XLA's GPU scatter uses atomics), so instead:

1. XLA sorts the ids (stable, invalid ids last) and finds where each run of
   equal ids starts: one *segment* per distinct touched row;
2. a Pallas kernel runs one program per segment, sums that row's
   contributions in their original order in float32, and writes the row
   once. No two programs write the same row, so the result is bit-for-bit
   reproducible on any backend, and the ``[ids, features]`` row-gradient
   buffer is never built: for a bag, ``coef[j] * grads[src[j]]`` is formed on
   the fly from the ``[batch, features]`` cotangent.

Untouched rows keep the zeros of an aliased, pre-zeroed output. A hot row
(Zipf ids) is summed by one program serially: deterministic, at the cost of
balance.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from embedlib.kernels.gather_pallas import compiler_params, lane_columns
from embedlib.sharding import match_varying, out_struct


def segments(ids: jax.Array, num_embeddings: int):
  """Sorts ids into segments of equal valid ids (XLA; the kernel's index plan).

  Args:
    ids: int32 ``[n]``.
    num_embeddings: rows of the table; ids outside ``[0, num_embeddings)``
      are dropped.

  Returns:
    ``(order, starts, ends, rows, count)``: ``order`` ``[n]`` the stable
    sorting permutation; for segment ``u < count``, its sorted positions are
    ``starts[u]:ends[u]`` and its table row is ``rows[u]``; entries from
    ``count`` on are empty segments (``starts == ends``).

  >>> import jax.numpy as jnp
  >>> order, starts, ends, rows, count = segments(jnp.array([3, -1, 1, 3]), 4)
  >>> order.tolist(), starts.tolist(), ends.tolist(), rows[:2].tolist(), int(count)
  ([2, 0, 3, 1], [0, 1, 3, 3], [1, 3, 3, 3], [1, 3], 2)
  """
  n = ids.shape[0]
  valid = (ids >= 0) & (ids < num_embeddings)
  key = jnp.where(valid, ids, num_embeddings)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  skey = key[order]
  num_valid = jnp.sum(valid).astype(jnp.int32)
  first = jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]])
  is_start = first & (skey < num_embeddings)
  count = jnp.sum(is_start).astype(jnp.int32)
  starts = jnp.nonzero(is_start, size=n, fill_value=n)[0].astype(jnp.int32)
  nxt = jnp.concatenate([starts[1:], jnp.full((1,), n, jnp.int32)])
  u = jnp.arange(n, dtype=jnp.int32)
  ends = jnp.where(u + 1 < count, nxt, num_valid)
  starts = jnp.where(u < count, starts, num_valid)
  ends = jnp.where(u < count, ends, num_valid)
  rows = skey[jnp.minimum(starts, n - 1)]
  return order, starts, ends, rows, count


def _segment_kernel(*refs, features, num_embeddings, scaled):
  if scaled:
    starts_ref, ends_ref, rows_ref, src_ref, coef_ref, grads_ref, _, out_ref = refs
  else:
    starts_ref, ends_ref, rows_ref, src_ref, grads_ref, _, out_ref = refs
  u = pl.program_id(0)
  start = starts_ref[u]
  end = ends_ref[u]
  row = rows_ref[u]
  cols = lane_columns(features)
  lanes = cols.shape[0]

  def body(j, acc):
    src = jnp.full((lanes,), src_ref[j], jnp.int32)
    g = grads_ref[src, cols].astype(jnp.float32)
    return acc + (coef_ref[j] * g if scaled else g)

  acc = jax.lax.fori_loop(start, end, body, jnp.zeros((lanes,), jnp.float32))

  # Empty segments (u >= count) own no row; the clamped lanes rewrite the
  # last column with its own value.
  @pl.when((start < end) & (row < num_embeddings))
  def _():
    out_ref[jnp.full((lanes,), row, jnp.int32), cols] = acc.astype(out_ref.dtype)


def segment_sum_rows(
    grads: jax.Array,
    src: jax.Array,
    ids: jax.Array,
    num_embeddings: int,
    *,
    coef: jax.Array | None = None,
    dtype=None,
    interpret: bool = False,
) -> jax.Array:
  """Table gradient ``out[r] = sum_{j: ids[j] == r} coef[j] * grads[src[j]]``, deterministically.

  Equivalent JAX code::

    valid = (ids >= 0) & (ids < num_embeddings)
    contrib = coef[:, None] * grads[src]
    out = jax.ops.segment_sum(jnp.where(valid[:, None], contrib, 0),
                              jnp.where(valid, ids, 0), num_embeddings)

  Args:
    grads: ``[m, features]`` cotangent rows (a gather's output cotangent, or a
      bag's ``[batch, features]`` cotangent).
    src: int ``[n]``, the row of ``grads`` each id takes its gradient from.
    ids: int ``[n]``, the table row each id was read from.
    num_embeddings: rows of the table gradient.
    coef: optional float ``[n]`` factor per id (a bag's combiner weights).
    dtype: dtype of the result (default ``grads.dtype``).
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    ``[num_embeddings, features]`` in ``dtype``; summed in float32.

  >>> import jax.numpy as jnp
  >>> g = jnp.array([[1.0], [2.0], [4.0]])
  >>> segment_sum_rows(g, jnp.arange(3), jnp.array([1, 1, -1]), 3, interpret=True).tolist()
  [[0.0], [3.0], [0.0]]
  """
  dtype = grads.dtype if dtype is None else jnp.dtype(dtype)
  features = grads.shape[-1]
  ids = ids.reshape(-1).astype(jnp.int32)
  n = ids.shape[0]
  zeros = jnp.zeros((num_embeddings, features), dtype)
  if n == 0 or num_embeddings == 0 or features == 0 or grads.shape[0] == 0:
    return zeros
  order, starts, ends, rows, _ = segments(ids, num_embeddings)
  operands = [starts, ends, rows, src.reshape(-1).astype(jnp.int32)[order]]
  if coef is not None:
    operands.append(coef.reshape(-1).astype(jnp.float32)[order])
  operands = match_varying(*operands, grads, zeros)
  kernel = functools.partial(
      _segment_kernel,
      features=features,
      num_embeddings=num_embeddings,
      scaled=coef is not None,
  )
  return pl.pallas_call(
      kernel,
      out_shape=out_struct(zeros.shape, dtype, *operands),
      grid=(n,),
      input_output_aliases={len(operands) - 1: 0},
      compiler_params=compiler_params(num_warps=2),
      interpret=interpret,
      name="embedlib_segment_sum",
  )(*operands)
