"""Vocabulary (row) sharding: each rank owns a contiguous block of rows.

Lookup: ids to every rank of the group -> masked lookup of the rows this
rank owns -> sum of the partial rows (psum, or psum_scatter when the ranks
hold different tokens). Attend: logits for this rank's rows -> concatenated
over the group. Padded rows (the vocab rounded up to the group) are never
looked up, so they never reach an output or receive a gradient.
"""

from __future__ import annotations

import jax.numpy as jnp

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
  rows_per_rank = table.shape[0]
  local = ids - collectives.group_rank(plan.table_axes) * rows_per_rank
  # Invalid ids are -1 and stay negative after the shift: no rank owns them.
  local = jnp.where((ids >= 0) & (local >= 0) & (local < rows_per_rank), local, -1)
  rows = gather(table, local)
  return collectives.sum_partials(rows, plan.token_axes, plan.rest_axes)


def attend(table, query, *, plan):
  """Vocab-sharded ``query @ table.T``.

  Args:
    table: ``[padded_vocab / group, features]``.
    query: ``[tokens, ..., features]``.
    plan: the table's ``EmbeddingPlan``.

  Returns:
    ``[tokens, ..., padded_vocab]``; the caller drops the padded logits.
  """
  query = collectives.gather_tokens(query, plan.token_axes)
  logits = query @ table.T
  return collectives.concat_slices(logits, plan.token_axes, plan.rest_axes)
