"""The XLA lookups: ``kernel="xla"``'s gather, the bag of wide bags, the local scores.

Plain ``jnp`` ops: a row gather with zero rows for invalid ids (`gather`),
a pooled bag that gathers every id and segment-sums (`bag_segment_sum`,
which `bag_xla` takes for bags too wide to unroll), and a shard's logits
(`scores`). Their gradients are jax's own. The specification they and every
other kernel are tested against is ``kernels.reference``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedlib import invalid_ids
from embedlib.kernels.bags import bag_coefficients


def scores(query: jax.Array, table: jax.Array) -> jax.Array:
  """``query @ table.T``: a local shard's logits, ``[..., features]`` -> ``[..., rows]``.

  The attend of every layout calls it on its shard (``scores=``); a
  quantized table brings its own (``embedlib.quant.scores``).
  """
  return query @ table.T


def gather(table: jax.Array, ids: jax.Array) -> jax.Array:
  """Row gather with zero rows for invalid ids.

  Args:
    table: ``[num_embeddings, features]``, any float dtype.
    ids: int array of any shape.

  Returns:
    ``ids.shape + (features,)`` in ``table.dtype``.

  >>> import jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> gather(table, jnp.array([2, -1, 3])).tolist()
  [[4.0, 5.0], [0.0, 0.0], [0.0, 0.0]]
  """
  num_embeddings = table.shape[0]
  valid = invalid_ids.valid_mask(ids, num_embeddings)
  rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0, mode="clip")
  return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


def bag_segment_sum(
    table: jax.Array,
    ids: jax.Array,
    weights: jax.Array | None = None,
    *,
    combiner: str = "sum",
) -> jax.Array:
  """Pooled bag lookup: ``sum_l c[b, l] * table[ids[b, l]]`` (see `bag_coefficients`).

  Materialises ``[batch * bag, features]``; the Pallas kernel does not.

  Args:
    table: ``[num_embeddings, features]``.
    ids: int ``[batch, bag]``, padded with -1 (any invalid id is padding).
    weights: optional float ``[batch, bag]``.
    combiner: ``"sum"``, ``"mean"`` or ``"sqrtn"``.

  Returns:
    ``[batch, features]`` in ``table.dtype`` (accumulated in float32).

  >>> import jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> bag_segment_sum(table, jnp.array([[0, 2, -1], [-1, -1, -1]]), combiner="mean").tolist()
  [[2.0, 3.0], [0.0, 0.0]]
  """
  coef = bag_coefficients(ids, weights, table.shape[0], combiner)
  batch, bag = ids.shape
  # Flat rows then a sorted segment-sum, not an einsum of [batch, bag, features]
  # with the coefficients, which XLA's CPU backend runs slower.
  rows = gather(table, ids.reshape(-1)).astype(jnp.float32)
  rows = rows * coef.reshape(-1, 1)
  segments = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), bag)
  pooled = jax.ops.segment_sum(rows, segments, num_segments=batch, indices_are_sorted=True)
  return pooled.astype(table.dtype)


