"""What a pooled lookup takes besides the table: the combiner's coefficients, padded bags.

Every bag kernel pools ``sum_l c[b, l] * row[b, l]`` with the coefficients
of `bag_coefficients`; a ragged batch becomes padded bags with
`ragged_to_padded`. An id outside ``[0, num_embeddings)`` is padding: it
gets coefficient 0 and doesn't count towards ``mean`` or ``sqrtn``
(``embedlib.invalid_ids``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from embedlib import invalid_ids
from embedlib import options


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
  valid = invalid_ids.valid_mask(ids, num_embeddings)
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
