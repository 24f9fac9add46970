"""Pallas (Triton) pooled bag lookup: ``pooled[b] = combine_l w[b, l] * table[ids[b, l]]``.

The fusion is the point of a custom kernel here: XLA's ``take`` followed by a
reduction writes and re-reads ``[batch, bag, features]``; this kernel keeps a
``[bags_per_block, features]`` float32 accumulator in registers, walks the bag
slots, and writes only ``[batch, features]`` (as FBGEMM's table-batched
kernel does for PyTorch). The combiner's denominator (sum of valid weights or
root of their sum of squares) is accumulated in the same pass.

Widths that are not powers of two and a ragged last block are handled as in
`gather_pallas`: lanes are clamped onto the last real column / bag, never
masked, so the code runs unchanged in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from embedlib.kernels import bags
from embedlib.kernels.gather_pallas import (
    compiler_params,
    lane_columns,
    next_pow2,
)
from embedlib.sharding import match_varying, out_struct

#: Elements of one program's accumulator (bags per block x padded features).
ACC_ELEMENTS = 2048


def block_bags(batch: int, features: int) -> int:
  """Bags per program: a power of two so that the accumulator is about `ACC_ELEMENTS`."""
  return min(max(ACC_ELEMENTS // next_pow2(features), 1), next_pow2(batch))


def check_bag_shapes(ids: jax.Array, weights: jax.Array | None) -> None:
  """Raises ValueError unless ids are ``[batch, bag]`` and weights (if any) match them."""
  if ids.ndim != 2:
    raise ValueError(
        f"bag: ids must be [batch, bag] padded with -1, got shape {ids.shape}; "
        "turn ragged ids into that form with ragged_to_padded(values, lengths, max_bag)."
    )
  if weights is not None and weights.shape != ids.shape:
    raise ValueError(
        f"bag: weights shape {weights.shape} must equal ids shape {ids.shape} "
        "(one weight per id, any value at padding slots)."
    )


def _bag_kernel(*refs, batch, bag, num_embeddings, features, block, combiner, weighted):
  if weighted:
    ids_ref, w_ref, table_ref, out_ref = refs
  else:
    ids_ref, table_ref, out_ref = refs
    w_ref = None
  start = pl.program_id(0) * block
  # Lanes past the last bag redo the last bag: an identical, harmless write.
  bags = jnp.minimum(start + jnp.arange(block, dtype=jnp.int32), batch - 1)
  cols = lane_columns(features)
  lanes = cols.shape[0]
  cols2d = jnp.broadcast_to(cols[None, :], (block, lanes))

  def body(slot, carry):
    acc, wsum, w2sum = carry
    flat = bags * bag + slot
    ids = ids_ref[flat]
    valid = (ids >= 0) & (ids < num_embeddings)
    w = w_ref[flat] if weighted else jnp.ones((block,), jnp.float32)
    w = jnp.where(valid, w, 0.0)
    rows2d = jnp.broadcast_to(jnp.clip(ids, 0, num_embeddings - 1)[:, None], (block, lanes))
    vals = table_ref[rows2d, cols2d].astype(jnp.float32)
    return acc + w[:, None] * vals, wsum + w, w2sum + w * w

  zeros = jnp.zeros((block,), jnp.float32)
  acc, wsum, w2sum = jax.lax.fori_loop(
      0, bag, body, (jnp.zeros((block, lanes), jnp.float32), zeros, zeros)
  )
  if combiner != "sum":
    denom = wsum if combiner == "mean" else jnp.sqrt(w2sum)
    scale = jnp.where(denom == 0, 0.0, 1.0 / jnp.where(denom == 0, 1.0, denom))
    acc = acc * scale[:, None]
  bags2d = jnp.broadcast_to(bags[:, None], (block, lanes))
  out_ref[bags2d, cols2d] = acc.astype(out_ref.dtype)


def bag_pallas(
    table: jax.Array,
    ids: jax.Array,
    weights: jax.Array | None = None,
    *,
    combiner: str = "sum",
    interpret: bool = False,
) -> jax.Array:
  """Pooled bag lookup as a Triton Pallas kernel, without a ``[batch, bag, features]`` buffer.

  Equivalent JAX code (`embedlib.kernels.bag_reference`)::

    valid = (ids >= 0) & (ids < table.shape[0])
    w = jnp.where(valid, 1.0 if weights is None else weights, 0.0)
    denom = {"sum": 1, "mean": w.sum(-1), "sqrtn": sqrt((w * w).sum(-1))}[combiner]
    rows = jnp.where(valid[..., None], jnp.take(table, jnp.where(valid, ids, 0), axis=0), 0)
    pooled = jnp.einsum("bl,blf->bf", w, rows) / denom   # 0 where denom == 0

  Not differentiable by itself: use `embedlib.kernels.bag`.

  Args:
    table: ``[num_embeddings, features]``, any float dtype.
    ids: int ``[batch, bag]``; ids outside ``[0, num_embeddings)`` are padding.
    weights: optional float ``[batch, bag]``.
    combiner: ``"sum"``, ``"mean"`` or ``"sqrtn"``.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    ``[batch, features]`` in ``table.dtype`` (accumulated in float32).

  >>> import jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> bag_pallas(table, jnp.array([[0, 2, -1]]), combiner="mean", interpret=True).tolist()
  [[2.0, 3.0]]
  """
  bags.check_combiner(combiner)
  check_bag_shapes(ids, weights)
  num_embeddings, features = table.shape
  batch, bag = ids.shape
  if batch == 0 or bag == 0 or num_embeddings == 0 or features == 0:
    return jnp.zeros((batch, features), table.dtype)
  block = block_bags(batch, features)
  kernel = functools.partial(
      _bag_kernel,
      batch=batch,
      bag=bag,
      num_embeddings=num_embeddings,
      features=features,
      block=block,
      combiner=combiner,
      weighted=weights is not None,
  )
  operands = [ids.reshape(-1).astype(jnp.int32)]
  if weights is not None:
    operands.append(weights.reshape(-1).astype(jnp.float32))
  operands.append(table)
  operands = match_varying(*operands)
  return pl.pallas_call(
      kernel,
      out_shape=out_struct((batch, features), table.dtype, *operands),
      grid=(pl.cdiv(batch, block),),
      compiler_params=compiler_params(num_stages=2),
      interpret=interpret,
      name="embedlib_bag",
  )(*operands)
