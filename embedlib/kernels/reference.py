"""Pure-jnp reference lookups: the specification every kernel is tested against.

These are the "equivalent JAX code" of the Pallas kernels in this package and
the ``kernel="xla"`` implementation. They define the library's invalid-id rule
in one place: an id outside ``[0, num_embeddings)`` reads a zero row and
receives no gradient; in a bag it is padding and does not count towards the
combiner's denominator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from embedlib import options


def valid_ids(ids: jax.Array, num_embeddings: int) -> jax.Array:
  """Boolean mask of ids inside ``[0, num_embeddings)``.

  >>> import jax.numpy as jnp
  >>> valid_ids(jnp.array([-1, 0, 2, 3]), 3).tolist()
  [False, True, True, False]
  """
  return (ids >= 0) & (ids < num_embeddings)


def scores_reference(query: jax.Array, table: jax.Array) -> jax.Array:
  """``query @ table.T``: a local shard's logits, ``[..., features]`` -> ``[..., rows]``.

  The attend of every layout calls it on its shard (``scores=``); a
  quantized table brings its own (``embedlib.quant.scores``).
  """
  return query @ table.T


def check_combiner(combiner: str) -> None:
  """Raises ValueError unless ``combiner`` is one of ``options.COMBINERS``."""
  if combiner not in options.COMBINERS:
    raise ValueError(
        f"combiner={combiner!r} is not supported; use one of {options.COMBINERS}, "
        "e.g. bag(table, ids, combiner='mean')."
    )


def bag_coefficients(
    ids: jax.Array,
    weights: jax.Array | None,
    num_embeddings: int,
    combiner: str,
) -> jax.Array:
  """Per-id factor ``c[b, l]`` such that ``pooled[b] = sum_l c[b, l] * row[b, l]``.

  Padding ids get 0. ``mean`` divides by the sum of the valid weights,
  ``sqrtn`` by the root of their sum of squares; a zero denominator (an empty
  bag) gives factor 0, as TensorFlow's ``div_no_nan`` does.

  Args:
    ids: int ``[batch, bag]``.
    weights: float ``[batch, bag]`` or None (all ones).
    num_embeddings: rows of the (local) table.
    combiner: one of ``options.COMBINERS``.

  Returns:
    float32 ``[batch, bag]``.

  >>> import jax.numpy as jnp
  >>> bag_coefficients(jnp.array([[0, 1, -1]]), None, 4, "mean").tolist()
  [[0.5, 0.5, 0.0]]
  """
  check_combiner(combiner)
  valid = valid_ids(ids, num_embeddings)
  w = jnp.ones(ids.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
  w = jnp.where(valid, w, 0.0)
  if combiner == "sum":
    return w
  if combiner == "mean":
    denom = jnp.sum(w, axis=-1, keepdims=True)
  else:
    denom = jnp.sqrt(jnp.sum(w * w, axis=-1, keepdims=True))
  safe = jnp.where(denom == 0, 1.0, denom)
  return jnp.where(denom == 0, 0.0, w / safe)


def gather_reference(table: jax.Array, ids: jax.Array) -> jax.Array:
  """Row gather with zero rows for invalid ids.

  Args:
    table: ``[num_embeddings, features]``, any float dtype.
    ids: int array of any shape.

  Returns:
    ``ids.shape + (features,)`` in ``table.dtype``.

  >>> import jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> gather_reference(table, jnp.array([2, -1, 3])).tolist()
  [[4.0, 5.0], [0.0, 0.0], [0.0, 0.0]]
  """
  num_embeddings = table.shape[0]
  valid = valid_ids(ids, num_embeddings)
  rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0, mode="clip")
  return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


def bag_reference(
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
  >>> bag_reference(table, jnp.array([[0, 2, -1], [-1, -1, -1]]), combiner="mean").tolist()
  [[2.0, 3.0], [0.0, 0.0]]
  """
  coef = bag_coefficients(ids, weights, table.shape[0], combiner)
  batch, bag = ids.shape
  # Flat rows then a sorted segment-sum, not an einsum of [batch, bag, features]
  # with the coefficients, which XLA's CPU backend runs slower.
  rows = gather_reference(table, ids.reshape(-1)).astype(jnp.float32)
  rows = rows * coef.reshape(-1, 1)
  segments = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), bag)
  pooled = jax.ops.segment_sum(rows, segments, num_segments=batch, indices_are_sorted=True)
  return pooled.astype(table.dtype)


def ragged_to_padded(values, lengths, max_bag: int, weights=None):
  """Turns a ragged batch (flat ``values`` + per-bag ``lengths``) into padded bags.

  Args:
    values: int ``[total]``, the ids of all bags back to back.
    lengths: int ``[batch]``, ids per bag; ``sum(lengths) <= total``.
    max_bag: static capacity (bag width of the result).
    weights: optional float ``[total]`` aligned with ``values``.

  Returns:
    ids ``[batch, max_bag]`` padded with -1, or ``(ids, weights)`` with
    weights padded with 0 when ``weights`` is given.

  Raises:
    ValueError: in eager mode, when a bag is longer than ``max_bag`` (under
      ``jit`` the capacity cannot be checked and longer bags are truncated).

  >>> import jax.numpy as jnp
  >>> ragged_to_padded(jnp.array([5, 6, 7]), jnp.array([2, 0, 1]), 2).tolist()
  [[5, 6], [-1, -1], [7, -1]]
  """
  values = jnp.asarray(values)
  lengths = jnp.asarray(lengths)
  if not isinstance(lengths, jax.core.Tracer):
    longest = int(np.max(np.asarray(lengths), initial=0))
    if longest > max_bag:
      raise ValueError(
          f"ragged_to_padded: a bag holds {longest} ids but max_bag={max_bag}; "
          f"pass max_bag>={longest} so that no id is dropped."
      )
    total = int(np.sum(np.asarray(lengths)))
    if total > values.shape[0]:
      raise ValueError(
          f"ragged_to_padded: lengths sum to {total} but values holds "
          f"{values.shape[0]} ids; lengths must describe values."
      )
  starts = jnp.cumsum(lengths) - lengths
  slot = jnp.arange(max_bag)
  pos = starts[:, None] + slot[None, :]
  present = slot[None, :] < lengths[:, None]
  safe = jnp.clip(pos, 0, max(values.shape[0] - 1, 0))
  # Nothing to gather without values or bags. An empty gather of an array on
  # an Explicit mesh also fails eagerly inside JAX (jax 0.10).
  empty = values.shape[0] == 0 or pos.shape[0] == 0
  if empty:
    ids = jnp.full(pos.shape, -1, values.dtype)
  else:
    ids = jnp.where(present, values[safe], -1).astype(values.dtype)
  if weights is None:
    return ids
  weights = jnp.asarray(weights)
  if empty:
    return ids, jnp.zeros(pos.shape, weights.dtype)
  return ids, jnp.where(present, weights[safe], 0).astype(weights.dtype)
