"""``query @ table.T`` over a mesh: the attend of every layout, under the one runner."""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from embedlib import kernels
from embedlib.strategies import runner
from embedlib.strategies.sharded import STRATEGIES


def attend(table, query, *, plan, mesh, scores=kernels.scores):
  """``query @ logical_table.T`` from the physical table.

  Args:
    table: the physical table, ``plan.padded_shape``.
    query: ``[tokens, ..., features]``.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh the plan was made for, or None for one device.
    scores: each shard's ``query @ table.T`` (a quantized table's own:
      ``embedlib.quant.scores``).

  Returns:
    ``[tokens, ..., num_embeddings]``.
  """
  _no_stack(plan)
  pad_cols = plan.padded_shape[1] - query.shape[-1]
  if pad_cols:
    query = jnp.pad(query, [(0, 0)] * (query.ndim - 1) + [(0, pad_cols)])
  strategy = STRATEGIES[plan.strategy]
  body = lambda t, q: strategy.attend(t, q, plan=plan, scores=scores)
  return runner.run(body, table, query, 0, plan=plan, mesh=mesh, width=plan.num_embeddings)


def attend_vocab_split(table, query, *, plan, mesh, scores=kernels.scores):
  """``query @ table.T`` left split over the vocabulary as the table's rows are.

  The vocab strategy without its output step: each rank keeps the logits of
  its own rows (``vocab.local_logits``), so no device holds a token's whole
  row of logits. Ranks along the token axes hold different tokens, so their
  queries are gathered (the input step of every lookup); the logits' token
  dimension stays split over the data axes outside the table group.

  Args:
    table: the physical table, ``plan.padded_shape``, split by rows
      (``plan.strategy`` one of ``options.ROW_BLOCKS``).
    query: ``[tokens, ..., features]``.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh the plan was made for (not None).
    scores: each shard's ``query @ table.T``.

  Returns:
    ``[tokens, ..., padded_vocab]``, laid out as ``vocab_split_spec``; the
    logits of padded rows are zero.
  """
  _no_stack(plan)
  pad_cols = plan.padded_shape[1] - query.shape[-1]
  if pad_cols:  # a grid's padded columns
    query = jnp.pad(query, [(0, 0)] * (query.ndim - 1) + [(0, pad_cols)])
  body = lambda t, q: STRATEGIES[plan.strategy].local_logits(t, q, plan=plan, scores=scores)
  return runner.run(body, table, query, 0, plan=plan, mesh=mesh,
                    out_spec=vocab_split_spec(plan, query.ndim))


def _no_stack(plan):
  if plan.placement is not None:
    raise ValueError(
        f"{plan.name}: attend is not defined on a stack of tables (its logits would "
        f"cover {len(plan.placement.members)} tables); attend with a table of its own "
        f"(a TableSpec without a table placement)."
    )


def vocab_split_spec(plan, ndim: int) -> P:
  """Layout of ``attend_vocab_split``'s logits of rank ``ndim``.

  The vocabulary over ``plan.table_axes``; the tokens over the data axes
  outside the table group (the token axes' tokens were gathered).
  """
  outer = plan.outer_axes
  return P(outer or None, *(None,) * (ndim - 2), plan.table_axes)
