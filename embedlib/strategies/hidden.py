"""Hidden (column) sharding: each rank owns a slice of every row's columns.

Lookup: ids to every rank of the group -> gather of this rank's column slice
-> columns concatenated over the group (all_gather, or all_to_all when the
ranks hold different tokens: the recommender seed's design). Attend: this
rank's columns of the query times its slice -> partial logits summed over
the group. Padded columns are zero and are sliced off by the caller.
"""

from __future__ import annotations

from jax import lax

from embedlib.strategies import collectives


def lookup(table, ids, *, plan, gather):
  """Hidden-sharded lookup.

  Args:
    table: ``[num_embeddings, padded_features / group]``.
    ids: ``[tokens, ...]`` int32, ``-1`` for invalid ids.
    plan: the table's ``EmbeddingPlan``.
    gather: local kernel; ids outside the table give zero rows.

  Returns:
    ``[tokens, ..., padded_features]``; the caller drops padded columns.
  """
  ids = collectives.gather_tokens(ids, plan.token_axes)
  cols = gather(table, ids)
  return collectives.concat_slices(cols, plan.token_axes, plan.rest_axes)


def bag_lookup(table, ids, weights, *, plan, bag, combiner):
  """Hidden-sharded pooled bag lookup: pool this rank's columns, then concat.

  Every rank holds every row, so each pools whole bags (combiner included)
  on its column slice; only pooled ``[tokens, width]`` blocks travel.

  Args:
    table: ``[num_embeddings, padded_features / group]``.
    ids: ``[tokens, bag]`` int32, ``-1`` for padding and invalid ids.
    weights: ``[tokens, bag]`` float, or None for all ones.
    plan: the table's ``EmbeddingPlan``.
    bag: local pooled kernel ``bag(table, ids, weights, combiner=...)``.
    combiner: ``"sum" | "mean" | "sqrtn"``.

  Returns:
    ``[tokens, padded_features]``; the caller drops padded columns.
  """
  ids = collectives.gather_tokens(ids, plan.token_axes)
  if weights is not None:
    weights = collectives.gather_tokens(weights, plan.token_axes)
  pooled = bag(table, ids, weights, combiner=combiner)
  return collectives.concat_slices(pooled, plan.token_axes, plan.rest_axes)


def attend(table, query, *, plan):
  """Hidden-sharded ``query @ table.T``.

  Args:
    table: ``[num_embeddings, padded_features / group]``.
    query: ``[tokens, ..., padded_features]`` (zero in the padded columns).
    plan: the table's ``EmbeddingPlan``.

  Returns:
    ``[tokens, ..., num_embeddings]``.
  """
  query = collectives.gather_tokens(query, plan.token_axes)
  width = table.shape[1]
  start = collectives.group_rank(plan.table_axes) * width
  local = lax.dynamic_slice_in_dim(query, start, width, axis=query.ndim - 1)
  partial = local @ table.T
  return collectives.sum_partials(partial, plan.token_axes, plan.rest_axes)
