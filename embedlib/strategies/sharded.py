"""Runs a strategy over a mesh: token padding, placement and ``shard_map``.

The strategy functions (``replicated``, ``vocab``, ``hidden``) see local
shards only. This module gives them their inputs: it pads the token (batch)
dimension to a multiple of the data shards (with invalid ids, which look up
zeros), lays ids and table out as the plan says, runs the strategy inside
``jax.shard_map`` and strips the padding from the result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from embedlib import _compat
from embedlib import axes as axes_lib
from embedlib.strategies import hidden, replicated, vocab

_STRATEGIES = {
    axes_lib.REPLICATED: replicated,
    axes_lib.VOCAB: vocab,
    axes_lib.HIDDEN: hidden,
}


def _pad_tokens(x, multiple, fill):
  pad = -x.shape[0] % multiple
  if not pad:
    return x
  widths = [(0, pad)] + [(0, 0)] * (x.ndim - 1)
  return jnp.pad(x, widths, constant_values=fill)


def _unpad_tokens(x, tokens, mesh):
  if x.shape[0] == tokens:
    return x
  # The ids were unsharded (an uneven batch can't be a sharded jax.Array):
  # hand the result back unsharded too. Explicit axes forbid slicing a
  # sharded dimension, so gather first.
  x = _compat.place(x, mesh, P())
  return x[:tokens]


def _run(body, table, x, *, plan, mesh, fill):
  """Runs ``body(table_shard, x_shard)`` over the mesh on token-split ``x``."""
  if mesh is None:
    return body(table, x)
  tokens = x.shape[0]
  token_spec = P(plan.data_axes or None)
  table_spec = P(*plan.table_spec)
  x = _compat.place(_pad_tokens(x, plan.data_shards, fill), mesh, token_spec)
  table = _compat.place(table, mesh, table_spec)
  out = _compat.shard_map(
      body, mesh=mesh, in_specs=(table_spec, token_spec), out_specs=token_spec
  )(table, x)
  return _unpad_tokens(out, tokens, mesh)


def lookup(table, ids, *, plan, mesh, gather):
  """Looks up ``ids`` in a physical (padded, sharded) table.

  Args:
    table: the physical table, ``plan.padded_shape``.
    ids: ``[tokens, ...]`` int32 with ``-1`` for every invalid id; the
      leading dimension is the one split over ``plan.data_axes``.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh the plan was made for, or None for one device.
    gather: local kernel ``gather(table_shard, ids) -> rows``.

  Returns:
    ``ids.shape + (plan.features,)``.
  """
  strategy = _STRATEGIES[plan.strategy]
  body = lambda t, i: strategy.lookup(t, i, plan=plan, gather=gather)
  out = _run(body, table, ids, plan=plan, mesh=mesh, fill=-1)
  return out[..., : plan.features]


def attend(table, query, *, plan, mesh):
  """``query @ logical_table.T`` from the physical table.

  Args:
    table: the physical table, ``plan.padded_shape``.
    query: ``[tokens, ..., features]``.
    plan: the table's ``EmbeddingPlan``.
    mesh: as in ``lookup``.

  Returns:
    ``[tokens, ..., num_embeddings]``.
  """
  pad_cols = plan.padded_shape[1] - query.shape[-1]
  if pad_cols:
    query = jnp.pad(query, [(0, 0)] * (query.ndim - 1) + [(0, pad_cols)])
  strategy = _STRATEGIES[plan.strategy]
  body = lambda t, q: strategy.attend(t, q, plan=plan)
  out = _run(body, table, query, plan=plan, mesh=mesh, fill=0)
  return out[..., : plan.num_embeddings]
