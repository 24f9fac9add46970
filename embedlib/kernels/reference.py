"""The specification every lookup kernel is tested against: tests and benchmarks import it.

Nothing in the library calls these (``tests/test_structure.py`` keeps it
so): they say what a lookup is, as plainly as ``jnp`` says it, and each
kernel (``kernel="xla"``'s `xla` ops, the Pallas and Mosaic kernels, the
C++ gather, the quantized lookups) and each layout is checked against them.
Written apart from the kernels, so that a mistake in one is not its own
oracle. The invalid-id rule is ``embedlib.invalid_ids``'s: an id outside
``[0, num_embeddings)`` reads a zero row and gets no gradient; in a bag it
is padding and does not count towards the combiner's denominator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedlib import options


def gather_reference(table: jax.Array, ids: jax.Array) -> jax.Array:
  """``table[ids]``, a zero row for each invalid id: ``ids.shape + (features,)``.

  >>> import jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> gather_reference(table, jnp.array([2, -1, 3])).tolist()
  [[4.0, 5.0], [0.0, 0.0], [0.0, 0.0]]
  """
  valid = (ids >= 0) & (ids < table.shape[0])
  rows = table[jnp.clip(ids, 0, table.shape[0] - 1)]
  return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


def bag_reference(table: jax.Array, ids: jax.Array, weights: jax.Array | None = None, *,
                  combiner: str = "sum") -> jax.Array:
  """Each bag's rows pooled: ``[batch, bag]`` ids (``-1`` padded) to ``[batch, features]``.

  ``sum`` adds the rows times their weights (ones when None); ``mean``
  divides that by the bag's summed weights, ``sqrtn`` by the root of their
  summed squares; an empty bag pools to zeros. Summed in float32, returned
  in ``table.dtype``.

  >>> import jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> bag_reference(table, jnp.array([[0, 2, -1], [-1, -1, -1]]), combiner="mean").tolist()
  [[2.0, 3.0], [0.0, 0.0]]
  """
  if combiner not in options.COMBINERS:
    raise ValueError(f"combiner={combiner!r}; use one of {options.COMBINERS}.")
  valid = (ids >= 0) & (ids < table.shape[0])
  w = jnp.ones(ids.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
  w = jnp.where(valid, w, 0.0)
  if combiner != "sum":  # each weight over the bag's norm: c[b, l]
    norm = jnp.sum(w, axis=1) if combiner == "mean" else jnp.sqrt(jnp.sum(w * w, axis=1))
    w = jnp.where(norm[:, None] > 0, w / jnp.where(norm > 0, norm, 1.0)[:, None], 0.0)
  rows = gather_reference(table, ids).astype(jnp.float32)
  return jnp.sum(w[..., None] * rows, axis=1).astype(table.dtype)


def scores_reference(query: jax.Array, table: jax.Array) -> jax.Array:
  """``query @ table.T``: the logits ``attend`` gives, ``[..., features]`` -> ``[..., rows]``."""
  return jnp.einsum("...f,rf->...r", query, table)
