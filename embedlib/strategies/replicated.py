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
