"""Vocabulary (row) sharding: each rank owns a contiguous block of rows.

Lookup: ids to every rank of the group (``distribute``) -> masked lookup of
the rows this rank owns -> sum of the partial rows (psum, or psum_scatter
when the ranks hold different tokens: ``finish``). Attend: logits for this rank's rows -> concatenated
over the group, or left where they are for a vocab-parallel loss
(``local_logits``). Padded rows (the vocab rounded up to the group) are never
looked up, so they never reach an output or receive a gradient.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from embedlib import kernels
from embedlib.strategies import collectives, early


def owned_rows(ids, rows_per_rank, plan):
  """Shard-local row of each id this rank owns, ``-1`` for the others."""
  local = ids - collectives.group_rank(plan.table_axes) * rows_per_rank
  # Invalid ids are -1 and stay negative after the shift: no rank owns them.
  return jnp.where((ids >= 0) & (local >= 0) & (local < rows_per_rank), local, -1)


def distribute(ids, weights=None, *, plan, combiner=None):
  """Input distribution: the group's ids on every rank of it, and a bag's coefficients.

  Pooling is linear in the rows, so each rank pools only the ids it owns and
  the partial sums add up to the full bag. The combiner's factors (``mean``
  divides by the bag's total weight, ``sqrtn`` by its root sum of squares)
  must come from the whole bag, not from the ids one rank owns: they are
  computed here from the gathered ids and ``finish`` hands them to the
  local kernel as the weights of a plain sum.

  Args:
    ids: ``[tokens, ...]`` int32, ``-1`` for invalid ids (``[tokens, bag]``
      pooled, ``-1`` for padding too).
    weights: ``[tokens, bag]`` float per-id weights of a pooled lookup, or
      None for all ones.
    plan: the table's ``EmbeddingPlan``.
    combiner: ``"sum" | "mean" | "sqrtn"`` for a pooled lookup, else None.

  Returns:
    ``{"ids": [group_tokens, ...]}``, with ``"coef"`` ``[group_tokens, bag]``
    when pooled.
  """
  ids = collectives.gather_tokens(ids, plan.token_axes)
  if combiner is None:
    return {"ids": ids}
  if weights is not None:
    weights = collectives.gather_tokens(weights, plan.token_axes)
  return {"ids": ids,
          "coef": kernels.bag_coefficients(ids, weights, plan.num_embeddings, combiner)}


def finish(table, state, *, plan, gather=None, bag=None, combiner=None, corrections=None):
  """Local lookup of the owned rows, then the partial rows summed (output distribution).

  Args:
    table: ``[padded_vocab / group, features]``, this rank's rows.
    state: ``distribute``'s; with ``"rows"``, fetched early (``fetch_early``).
    plan: the table's ``EmbeddingPlan``.
    gather: local row kernel; ids outside the shard give zero rows.
    bag: local pooled kernel ``bag(table, ids, weights, combiner=...)``.
    combiner: unused (the state holds the bag's coefficients).
    corrections: for rows fetched early, the changed rows each token rank
      can receive (``early.correction_capacity``).

  Returns:
    ``[tokens, ..., features]``, or ``[tokens, features]`` pooled.
  """
  del combiner
  if "rows" in state:  # fetched a step early
    return rows_up_to_date(table, state, corrections, plan=plan, gather=gather)
  owned = owned_rows(state["ids"], table.shape[0], plan)
  if "coef" in state:
    rows = bag(table, owned, state["coef"], combiner="sum")
  else:
    rows = gather(table, owned)
  return collectives.sum_partials(rows, plan.token_axes, plan.rest_axes)


def fetch_early(table, state, *, plan, gather):
  """``distribute``'s state with the rows as ``table`` holds them now (early fetch).

  Each rank's partial rows (``"stale"``, kept where they were read) and
  their sum at the ranks that hold the tokens (``"rows"``): the lookup of
  this table now. Rows only: a bag's sum over its ids' owners can't be
  rebuilt bit for bit from per-id rows (the owners' partial sums and their
  psum add in another order), so pooled lookups are not fetched early.
  """
  stale = gather(table, owned_rows(state["ids"], table.shape[0], plan))
  return {**state, "stale": stale,
          "rows": collectives.sum_partials(stale, plan.token_axes, plan.rest_axes)}


def rows_up_to_date(table, got, corrections, *, plan, gather):
  """The early rows with every row the table has changed since replaced: ``finish`` exactly.

  Each rank reads the rows it owns of the gathered ids again and compares
  their bits with what it read before (``stale``); the changed ones (at
  most ``corrections`` per token rank) go to the token ranks that hold
  those tokens (an all_to_all over the token axes, then gathered over the
  rest axes, whose ranks hold the same tokens) and replace the early rows
  there. A step with more changed rows for one token rank than that sums
  every rank's rows again (``sum_partials``), as ``finish`` does. A vocab
  row is its owner's row plus the other ranks' zeros, so a corrected row
  is its owner's new row with -0.0 made 0.0, as that sum makes it.
  """
  token_axes, rest_axes = plan.token_axes, plan.rest_axes
  fresh = gather(table, owned_rows(got["ids"], table.shape[0], plan))
  rows = got["rows"]
  features = rows.shape[-1]
  ranks = fresh.shape[0] // rows.shape[0]  # along the token axes
  block = rows.size // features  # rows each token rank receives
  # A row no rank owns (an invalid id) reads zeros both times: never changed.
  changed = early.changed_rows(fresh, got["stale"]).reshape(ranks, block)
  need = lax.pmax(jnp.max(jnp.sum(changed, axis=1, dtype=jnp.int32)), plan.table_axes)
  fresh_flat = fresh.reshape(ranks * block, features)

  def corrected():
    # The changed rows first in each token rank's block, in order.
    order = jnp.argsort(~changed, axis=1, stable=True)[:, :corrections].astype(jnp.int32)
    kept = jnp.take_along_axis(changed, order, axis=1)
    start = jnp.arange(ranks, dtype=jnp.int32)[:, None] * block
    values = jnp.take(fresh_flat, (start + order).reshape(-1), axis=0)
    slots = jnp.where(kept, order, -1).reshape(-1)
    if token_axes:
      values = lax.all_to_all(values, token_axes, 0, 0, tiled=True)
      slots = lax.all_to_all(slots, token_axes, 0, 0, tiled=True)
    if rest_axes:
      values = collectives.gather_rest(values, rest_axes, 0)
      slots = collectives.gather_rest(slots, rest_axes, 0)
    if plan.group_size > 1:
      # In line a row is its owner's plus the others' zeros: a -0.0 comes out 0.0.
      values = jnp.where(values == 0, jnp.zeros_like(values), values)
    # Each row has one owner, so no two ranks send the same slot; unused
    # entries each point past the end at a place of their own.
    at = jnp.where(slots >= 0, slots, block + jnp.arange(slots.shape[0], dtype=jnp.int32))
    out = rows.reshape(block, features).at[at].set(values, mode="drop", unique_indices=True)
    return out.reshape(rows.shape)

  def refetch():
    return collectives.sum_partials(fresh, token_axes, rest_axes)

  return lax.cond(need > corrections, refetch, corrected)


def attend(table, query, *, plan, scores=kernels.scores):
  """Vocab-sharded ``query @ table.T``, every rank's tokens with the whole vocabulary.

  Args:
    table: ``[padded_vocab / group, features]``.
    query: ``[tokens, ..., features]``.
    plan: the table's ``EmbeddingPlan``.
    scores: the local ``query @ table.T`` (``kernels.scores``).

  Returns:
    ``[tokens, ..., padded_vocab]``; the caller drops the padded logits.
  """
  logits = local_logits(table, query, plan=plan, scores=scores)
  return collectives.concat_slices(logits, plan.token_axes, plan.rest_axes)


def local_logits(table, query, *, plan, scores=kernels.scores):
  """This rank's vocabulary block of the logits: attend without its output step.

  What a vocab-parallel loss consumes: no rank ever holds more than its own
  rows' logits. The logits of padded rows are zero (padded rows are).

  Args:
    table: ``[padded_vocab / group, features]``, this rank's rows.
    query: ``[tokens, ..., features]`` local to this rank.
    plan: the table's ``EmbeddingPlan``.
    scores: the local ``query @ table.T``.

  Returns:
    ``[group_tokens, ..., padded_vocab / group]``: the tokens of every rank
    along ``plan.token_axes`` (gathered), this rank's block of columns.
  """
  query = collectives.gather_tokens(query, plan.token_axes)
  return scores(query, table)
