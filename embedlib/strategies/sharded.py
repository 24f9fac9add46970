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


def _restore_tokens(x, tokens, mesh, spec):
  """Strips token padding and gives the result the ids' own batch split.

  On Explicit axes the batch split is part of the array's type, so a lookup
  returns its rows split the way its ids were (a drop-in for ``jnp.take``):
  ids already split over the data axes cost nothing here.
  """
  if x.shape[0] != tokens:
    # An uneven batch can't have been split: gather, as slicing a split
    # dimension is not allowed on Explicit axes.
    x = _compat.place(x, mesh, P())[:tokens]
  if spec is not None and spec != _compat.leading_spec(x, mesh):
    x = _compat.place(x, mesh, P(spec or None))
  return x


def _run(body, table, x, *, plan, mesh, fill, check_vma=True):
  """Runs ``body(table_shard, x_shard)`` over the mesh on token-split ``x``.

  ``x`` may be a tuple of arrays sharing their leading (token) dimension,
  with ``fill`` a tuple of the same structure (one padding value each); the
  result takes the batch split of the first.
  """
  if mesh is None:
    return body(table, x)
  first = jax.tree.leaves(x)[0]
  tokens = first.shape[0]
  spec = _compat.leading_spec(first, mesh)
  token_spec = P(plan.data_axes or None)
  table_spec = P(*plan.table_spec)
  x = jax.tree.map(
      lambda a, f: _compat.place(_pad_tokens(a, plan.data_shards, f), mesh, token_spec),
      x,
      fill,
  )
  table = _compat.place(table, mesh, table_spec)
  out = _compat.shard_map(
      body, mesh=mesh, in_specs=(table_spec, token_spec), out_specs=token_spec,
      check_vma=check_vma,
  )(table, x)
  return _restore_tokens(out, tokens, mesh, spec)


def lookup(table, ids, *, plan, mesh, gather, check_vma=True):
  """Looks up ``ids`` in a physical (padded, sharded) table.

  Args:
    table: the physical table, ``plan.padded_shape``.
    ids: ``[tokens, ...]`` int32 with ``-1`` for every invalid id; the
      leading dimension is the one split over ``plan.data_axes``.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh the plan was made for, or None for one device.
    gather: local kernel ``gather(table_shard, ids) -> rows``.
    check_vma: shard_map's type check; off only for the Pallas interpreter
      (``kernels.shard_map_check_vma``).

  Returns:
    ``ids.shape + (plan.features,)``.
  """
  strategy = _STRATEGIES[plan.strategy]
  body = lambda t, i: strategy.lookup(t, i, plan=plan, gather=gather)
  out = _run(body, table, ids, plan=plan, mesh=mesh, fill=-1, check_vma=check_vma)
  return out[..., : plan.features]


def lookup_bag(table, ids, weights=None, *, plan, mesh, bag, combiner="sum",
               check_vma=True):
  """Pooled lookup of padded bags in a physical (padded, sharded) table.

  No ``[tokens, bag, features]`` intermediate: each rank pools locally with
  the ``bag`` kernel and only pooled rows are communicated.

  Args:
    table: the physical table, ``plan.padded_shape``.
    ids: ``[tokens, bag]`` int32, ``-1`` for padding and every invalid id;
      the leading dimension is the one split over ``plan.data_axes``.
    weights: ``[tokens, bag]`` float, or None for all ones.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh the plan was made for, or None for one device.
    bag: local kernel ``bag(table_shard, ids, weights, combiner=...)``.
    combiner: ``"sum" | "mean" | "sqrtn"`` (TensorFlow semantics over the
      valid ids of each bag).

  Returns:
    ``[tokens, plan.features]``.
  """
  strategy = _STRATEGIES[plan.strategy]
  run = lambda t, i, w: strategy.bag_lookup(
      t, i, w, plan=plan, bag=bag, combiner=combiner
  )
  if weights is None:
    out = _run(lambda t, i: run(t, i, None), table, ids, plan=plan, mesh=mesh, fill=-1,
               check_vma=check_vma)
  else:
    out = _run(
        lambda t, x: run(t, *x), table, (ids, weights), plan=plan, mesh=mesh, fill=(-1, 0),
        check_vma=check_vma,
    )
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
