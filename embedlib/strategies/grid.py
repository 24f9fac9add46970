"""Grid sharding: rows split over ``table_axes`` and columns over ``column_axes``.

What FSDP x tensor-parallel LLM code asks for with ``P('tensor', 'fsdp')``:
each rank holds a block of rows of a block of columns. A grid lookup is the
vocab lookup of the rank's column block inside a hidden lookup: ids to every
rank of the column group, the vocab strategy over the row group (masked
lookup of the owned rows, partial rows summed), then the column blocks
concatenated over the column group. Attend nests the other way: the
hidden attend (this rank's columns of the query times its block, partial
logits summed over the column group) inside the vocab one (each row
group rank keeps, or concatenates, its rows' logits). Padded rows are never
looked up; padded columns are zero and sliced off by the caller.
"""

from __future__ import annotations

from jax import lax

from embedlib import kernels
from embedlib.strategies import collectives, vocab


def distribute(ids, weights=None, *, plan, combiner=None):
  """The ids (and a bag's weights) over the column group, then the vocab distribution.

  Returns:
    ``vocab.distribute``'s state over the row group.
  """
  ids = collectives.gather_tokens(ids, plan.column_token_axes)
  if combiner is not None and weights is not None:
    weights = collectives.gather_tokens(weights, plan.column_token_axes)
  return vocab.distribute(ids, weights, plan=plan, combiner=combiner)


def finish(table, state, *, plan, gather=None, bag=None, combiner=None, corrections=None):
  """The vocab finish of this rank's column block, then the blocks concatenated.

  Args:
    table: ``[padded_vocab / rows group, padded_features / columns group]``.
    state: ``distribute``'s.
    plan: the table's ``EmbeddingPlan``.
    gather: local row kernel; ids outside the shard give zero rows.
    bag: local pooled kernel.
    combiner: unused (the state holds the bag's coefficients).
    corrections: unused (nothing is fetched early).

  Returns:
    ``[tokens, ..., padded_features]`` (``[tokens, padded_features]``
    pooled); the caller drops padded columns.
  """
  del corrections
  block = vocab.finish(table, state, plan=plan, gather=gather, bag=bag, combiner=combiner)
  return collectives.concat_slices(block, plan.column_token_axes, plan.column_rest_axes)


def local_logits(table, query, *, plan, scores=kernels.scores):
  """This rank's rows' logits, summed over the column group: ``vocab.local_logits`` of a grid.

  Args:
    table: ``[padded_vocab / rows group, padded_features / columns group]``.
    query: ``[tokens, ..., padded_features]`` local to this rank (zero in
      the padded columns).
    plan: the table's ``EmbeddingPlan``.
    scores: the local ``query @ table.T`` (``kernels.scores``).

  Returns:
    ``[row_group_tokens, ..., padded_vocab / rows group]``: the tokens of
    every rank along ``plan.token_axes``, this rank's block of rows.
  """
  query = collectives.gather_tokens(query, plan.token_axes)
  query = collectives.gather_tokens(query, plan.column_token_axes)
  width = table.shape[1]
  start = collectives.group_rank(plan.column_axes) * width
  local = lax.dynamic_slice_in_dim(query, start, width, axis=query.ndim - 1)
  return collectives.sum_partials(scores(local, table), plan.column_token_axes,
                                  plan.column_rest_axes)


def attend(table, query, *, plan, scores=kernels.scores):
  """Grid-sharded ``query @ table.T``, every rank's tokens with the whole vocabulary.

  Args:
    table: ``[padded_vocab / rows group, padded_features / columns group]``.
    query: ``[tokens, ..., padded_features]`` (zero in the padded columns).
    plan: the table's ``EmbeddingPlan``.
    scores: the local ``query @ table.T``.

  Returns:
    ``[tokens, ..., padded_vocab]``; the caller drops the padded logits.
  """
  logits = local_logits(table, query, plan=plan, scores=scores)
  return collectives.concat_slices(logits, plan.token_axes, plan.rest_axes)
