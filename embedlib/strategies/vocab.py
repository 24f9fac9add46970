"""Vocabulary (row) sharding: each rank owns a contiguous block of rows.

Lookup: ids to every rank of the group -> masked lookup of the rows this
rank owns -> sum of the partial rows (psum, or psum_scatter when the ranks
hold different tokens). Attend: logits for this rank's rows -> concatenated
over the group, or left where they are for a vocab-parallel loss
(``local_logits``). Padded rows (the vocab rounded up to the group) are never
looked up, so they never reach an output or receive a gradient.
"""

from __future__ import annotations

import jax.numpy as jnp

from embedlib.kernels import reference
from embedlib.strategies import collectives


def lookup(table, ids, *, plan, gather):
  """Vocab-sharded lookup.

  Args:
    table: ``[padded_vocab / group, features]``, this rank's rows.
    ids: ``[tokens, ...]`` int32, ``-1`` for invalid ids.
    plan: the table's ``EmbeddingPlan``.
    gather: local kernel; ids outside the shard give zero rows.

  Returns:
    ``[tokens, ..., features]``.
  """
  ids = collectives.gather_tokens(ids, plan.token_axes)
  rows = gather(table, _owned(ids, table.shape[0], plan))
  return collectives.sum_partials(rows, plan.token_axes, plan.rest_axes)


def _owned(ids, rows_per_rank, plan):
  """Shard-local row of each id this rank owns, ``-1`` for the others."""
  local = ids - collectives.group_rank(plan.table_axes) * rows_per_rank
  # Invalid ids are -1 and stay negative after the shift: no rank owns them.
  return jnp.where((ids >= 0) & (local >= 0) & (local < rows_per_rank), local, -1)


def bag_lookup(table, ids, weights, *, plan, bag, combiner):
  """Vocab-sharded pooled bag lookup.

  Pooling is linear in the rows, so each rank pools only the ids it owns and
  the partial sums add up to the full bag. The combiner's factors (``mean``
  divides by the bag's total weight, ``sqrtn`` by its root sum of squares)
  must come from the whole bag, not from the ids one rank owns: they are
  computed here from the global ids and handed to the local kernel as
  weights of a plain sum.

  Args:
    table: ``[padded_vocab / group, features]``, this rank's rows.
    ids: ``[tokens, bag]`` int32, ``-1`` for padding and invalid ids.
    weights: ``[tokens, bag]`` float, or None for all ones.
    plan: the table's ``EmbeddingPlan``.
    bag: local pooled kernel ``bag(table, ids, weights, combiner=...)``.
    combiner: ``"sum" | "mean" | "sqrtn"``.

  Returns:
    ``[tokens, features]``.
  """
  ids = collectives.gather_tokens(ids, plan.token_axes)
  if weights is not None:
    weights = collectives.gather_tokens(weights, plan.token_axes)
  coef = reference.bag_coefficients(ids, weights, plan.num_embeddings, combiner)
  pooled = bag(table, _owned(ids, table.shape[0], plan), coef, combiner="sum")
  return collectives.sum_partials(pooled, plan.token_axes, plan.rest_axes)


def attend(table, query, *, plan):
  """Vocab-sharded ``query @ table.T``, every rank's tokens with the whole vocabulary.

  Args:
    table: ``[padded_vocab / group, features]``.
    query: ``[tokens, ..., features]``.
    plan: the table's ``EmbeddingPlan``.

  Returns:
    ``[tokens, ..., padded_vocab]``; the caller drops the padded logits.
  """
  logits = local_logits(table, query, plan=plan)
  return collectives.concat_slices(logits, plan.token_axes, plan.rest_axes)


def local_logits(table, query, *, plan):
  """This rank's vocabulary block of the logits: attend without its output step.

  What a vocab-parallel loss consumes: no rank ever holds more than its own
  rows' logits. The logits of padded rows are zero (padded rows are).

  Args:
    table: ``[padded_vocab / group, features]``, this rank's rows.
    query: ``[tokens, ..., features]`` local to this rank.
    plan: the table's ``EmbeddingPlan``.

  Returns:
    ``[group_tokens, ..., padded_vocab / group]``: the tokens of every rank
    along ``plan.token_axes`` (gathered), this rank's block of columns.
  """
  query = collectives.gather_tokens(query, plan.token_axes)
  return query @ table.T
