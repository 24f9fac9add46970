"""Hidden (column) sharding: each rank owns a slice of every row's columns.

Lookup: ids to every rank of the group (``distribute``) -> gather of this
rank's column slice -> columns concatenated over the group (``finish``:
all_gather, or all_to_all when the ranks hold different tokens, the
recommender seed's design). Attend: this
rank's columns of the query times its slice -> partial logits summed over
the group. Padded columns are zero and are sliced off by the caller.
"""

from __future__ import annotations

from jax import lax

from embedlib import kernels
from embedlib.strategies import collectives


def distribute(ids, weights=None, *, plan, combiner=None):
  """Input distribution: the group's ids (and a bag's weights) on every rank of it.

  Args:
    ids: ``[tokens, ...]`` int32, ``-1`` for invalid ids (and padding in a bag).
    weights: ``[tokens, bag]`` float, or None for all ones.
    plan: the table's ``EmbeddingPlan``.
    combiner: ``"sum" | "mean" | "sqrtn"`` for a pooled lookup, else None.

  Returns:
    ``{"ids": [group_tokens, ...]}``, with ``"weights"`` when pooled.
  """
  ids = collectives.gather_tokens(ids, plan.token_axes)
  if combiner is None:
    return {"ids": ids}
  if weights is not None:
    weights = collectives.gather_tokens(weights, plan.token_axes)
  return {"ids": ids, "weights": weights}


def finish(table, state, *, plan, gather=None, bag=None, combiner=None, corrections=None):
  """This rank's column slice of each row (or pooled bag), then the columns concatenated.

  Every rank holds every row, so each pools whole bags (combiner included)
  on its column slice; only pooled ``[tokens, width]`` blocks travel.

  Args:
    table: ``[num_embeddings, padded_features / group]``.
    state: ``distribute``'s.
    plan: the table's ``EmbeddingPlan``.
    gather: local row kernel; ids outside the table give zero rows.
    bag: local pooled kernel ``bag(table, ids, weights, combiner=...)``.
    combiner: the pooled lookup's, else None.
    corrections: unused (nothing is fetched early).

  Returns:
    ``[tokens, ..., padded_features]`` (``[tokens, padded_features]``
    pooled); the caller drops padded columns.
  """
  del corrections
  if combiner is None:
    cols = gather(table, state["ids"])
  else:
    cols = bag(table, state["ids"], state["weights"], combiner=combiner)
  return collectives.concat_slices(cols, plan.token_axes, plan.rest_axes)


def attend(table, query, *, plan, scores=kernels.scores):
  """Hidden-sharded ``query @ table.T``.

  Args:
    table: ``[num_embeddings, padded_features / group]``.
    query: ``[tokens, ..., padded_features]`` (zero in the padded columns).
    plan: the table's ``EmbeddingPlan``.
    scores: the local ``query @ table.T`` (``kernels.scores``).

  Returns:
    ``[tokens, ..., num_embeddings]``.
  """
  query = collectives.gather_tokens(query, plan.token_axes)
  width = table.shape[1]
  start = collectives.group_rank(plan.table_axes) * width
  local = lax.dynamic_slice_in_dim(query, start, width, axis=query.ndim - 1)
  partial = scores(local, table)
  return collectives.sum_partials(partial, plan.token_axes, plan.rest_axes)
