"""Replicated table: every device holds the whole table; no communication."""

from __future__ import annotations

from embedlib import kernels


def distribute(ids, weights=None, *, plan, combiner=None):
  """Input distribution: none (every device holds the whole table).

  Returns:
    ``{"ids": ids}``, with ``"weights"`` when pooled (``combiner`` given).
  """
  del plan
  return {"ids": ids} if combiner is None else {"ids": ids, "weights": weights}


def finish(table, state, *, plan, gather=None, bag=None, combiner=None, corrections=None):
  """Local lookup (or pooled bag) on the local copy; no output distribution.

  Args:
    table: ``[num_embeddings, features]``, the whole table.
    state: ``distribute``'s.
    plan: unused.
    gather: local row kernel; ids outside the table give zero rows.
    bag: local pooled kernel ``bag(table, ids, weights, combiner=...)``.
    combiner: the pooled lookup's, else None.
    corrections: unused.

  Returns:
    ``ids.shape + (features,)``, or ``[tokens, features]`` pooled.
  """
  del plan, corrections
  if combiner is None:
    return gather(table, state["ids"])
  return bag(table, state["ids"], state["weights"], combiner=combiner)


def attend(table, query, *, plan, scores=kernels.scores):
  """``query @ table.T`` on the local copy.

  Args:
    table: ``[num_embeddings, features]``.
    query: ``[tokens, ..., features]``.
    plan: unused.
    scores: the local ``query @ table.T`` (``kernels.scores``).

  Returns:
    ``[tokens, ..., num_embeddings]``.
  """
  del plan
  return scores(query, table)
