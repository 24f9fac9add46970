"""Replicated table: every device holds the whole table; no communication."""

from __future__ import annotations


def lookup(table, ids, *, plan, gather):
  """Input distribution: none. Local lookup. Output distribution: none.

  Args:
    table: ``[num_embeddings, features]``, the whole table.
    ids: ``[tokens, ...]`` int32, ``-1`` for invalid ids.
    plan: the table's ``EmbeddingPlan`` (unused: nothing to distribute).
    gather: local kernel; ids outside the table give zero rows.

  Returns:
    ``ids.shape + (features,)``.
  """
  del plan
  return gather(table, ids)


def bag_lookup(table, ids, weights, *, plan, bag, combiner):
  """Pooled bag lookup on the local copy; no communication.

  Args:
    table: ``[num_embeddings, features]``, the whole table.
    ids: ``[tokens, bag]`` int32, ``-1`` for padding and invalid ids.
    weights: ``[tokens, bag]`` float, or None for all ones.
    plan: unused.
    bag: local pooled kernel ``bag(table, ids, weights, combiner=...)``.
    combiner: ``"sum" | "mean" | "sqrtn"``.

  Returns:
    ``[tokens, features]``.
  """
  del plan
  return bag(table, ids, weights, combiner=combiner)


def attend(table, query, *, plan):
  """``query @ table.T`` on the local copy.

  Args:
    table: ``[num_embeddings, features]``.
    query: ``[tokens, ..., features]``.
    plan: unused.

  Returns:
    ``[tokens, ..., num_embeddings]``.
  """
  del plan
  return query @ table.T
