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
from embedlib import sharding as sharding_lib
from embedlib import options
from embedlib.strategies import grid, hidden, replicated, routed, rowmap, vocab
from embedlib.strategies.request import Request

# Routed tables share vocab's layout: attend, and the lookups of a step whose
# route overflows, are vocab's.
_STRATEGIES = {
    options.REPLICATED: replicated,
    options.VOCAB: vocab,
    options.HIDDEN: hidden,
    options.ROUTED: vocab,
    options.GRID: grid,
}


def no_context_mesh():
  """A context without the mesh set by ``jax.set_mesh``, for calling ``shard_map``.

  ``shard_map`` is given its mesh explicitly and needs none in context. With
  one in context, ``checkify`` fails to trace a ``shard_map`` that follows a
  ``checkify.check`` (its error values are rebuilt outside the manual mesh:
  seen on jax 0.10.2 and 0.12), which would break ``invalid_ids="error"``
  and the dedup capacity check under ``jit``.
  """
  return _compat.use_abstract_mesh(_compat.AbstractMesh((), ()))


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
  spec = sharding_lib.leading_spec(first, mesh)
  token_spec = P(plan.data_axes or None)
  table_spec = P(*plan.table_spec)
  x = jax.tree.map(
      lambda a, f: sharding_lib.place(sharding_lib.pad_tokens(a, plan.data_shards, f), mesh, token_spec),
      x,
      fill,
  )
  table = sharding_lib.place(table, mesh, table_spec)
  with no_context_mesh():
    out = _compat.shard_map(
        body, mesh=mesh, in_specs=(table_spec, token_spec), out_specs=token_spec,
        check_vma=check_vma,
    )(table, x)
  return sharding_lib.restore_tokens(out, tokens, mesh, spec)


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
  if _routes(plan, mesh):
    (out,), _, _ = routed_requests(table, (Request(ids),), plan=plan, mesh=mesh,
                                   gather=gather, bag=None, check_vma=check_vma)
    return out
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
  if _routes(plan, mesh):
    (out,), _, _ = routed_requests(table, (Request(ids, weights, combiner),), plan=plan,
                                   mesh=mesh, gather=None, bag=bag, check_vma=check_vma)
    return out
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


def lookup_requests(table, requests, *, plan, mesh, gather, bag, check_vma=True):
  """Each ``Request``'s rows: unpooled (``lookup``) or pooled (``lookup_bag``).

  Returns:
    One output per request: ``ids.shape + (plan.features,)`` unpooled,
    ``[batch, plan.features]`` pooled.
  """
  if _routes(plan, mesh):
    out, _, _ = routed_requests(table, requests, plan=plan, mesh=mesh, gather=gather,
                                bag=bag, check_vma=check_vma)
    return out
  return tuple(
      lookup_bag(table, r.ids, r.weights, plan=plan, mesh=mesh, bag=bag,
                 combiner=r.combiner, check_vma=check_vma)
      if r.pooled else
      lookup(table, r.ids, plan=plan, mesh=mesh, gather=gather, check_vma=check_vma)
      for r in requests
  )


def _routes(plan, mesh) -> bool:
  """Whether lookups of ``plan`` take the route (a routed table over several ranks)."""
  return plan.strategy == options.ROUTED and mesh is not None and plan.group_size > 1


def routed_requests(table, requests, *, plan, mesh, gather, bag, check_vma=True,
                    fallback=True):
  """The requests of a routed table, routed together (``routed.lookup_requests``).

  The route's capacity is ``plan.capacity_for`` the ids one device holds
  over all ``requests`` (static: their shapes).

  Args:
    table: the physical table, ``plan.padded_shape``.
    requests: ``Request`` s sharing the batch (leading) dimension, ids
      ``-1`` for invalid.
    plan: the table's ``EmbeddingPlan`` (``strategy == "routed"``).
    mesh: the mesh, or None for one device.
    gather: local row kernel.
    bag: local pooled kernel.
    check_vma: shard_map's type check (off for the Pallas interpreter).
    fallback: on overflow, the vocab path (else only report it).

  Returns:
    ``(outputs, need, capacity)``: one output per request, as
    ``lookup_requests`` gives them; the largest bucket any group needed
    (int32 scalar); the capacity used.
  """
  if not _routes(plan, mesh):  # one owner: nothing to route
    out = lookup_requests(table, requests, plan=plan, mesh=mesh, gather=gather, bag=bag,
                          check_vma=check_vma)
    return out, jnp.int32(0), 0
  batch = requests[0].ids.shape[0]
  capacity = route_capacity(requests, plan)
  spec = sharding_lib.leading_spec(requests[0].ids, mesh)
  token_spec = P(plan.data_axes or None)
  table_spec = P(*plan.table_spec)
  ids = tuple(sharding_lib.place(sharding_lib.pad_tokens(r.ids, plan.data_shards, -1), mesh,
                                 token_spec) for r in requests)
  weights = tuple(
      sharding_lib.place(sharding_lib.pad_tokens(r.weights, plan.data_shards, 0), mesh,
                         token_spec)
      for r in requests if r.weights is not None
  )
  table = sharding_lib.place(table, mesh, table_spec)

  def body(table, ids, weights):
    weights = iter(weights)
    # A stack's logical rows to the physical rows its placement gives them.
    local = tuple(
        Request(rowmap.physical_ids(i, plan), next(weights) if r.weights is not None else None,
                r.combiner)
        for i, r in zip(ids, requests)
    )
    out, need = routed.lookup_requests(table, local, plan=plan, gather=gather, bag=bag,
                                       capacity=capacity, fallback=fallback)
    return out, need[None]

  with no_context_mesh():
    out, need = _compat.shard_map(
        body, mesh=mesh, in_specs=(table_spec, token_spec, token_spec),
        out_specs=((token_spec,) * len(requests), token_spec), check_vma=check_vma,
    )(table, ids, weights)
  out = tuple(
      sharding_lib.restore_tokens(o, batch, mesh, spec)[..., : plan.features] for o in out
  )
  return out, jnp.max(need), capacity


def route_capacity(requests, plan) -> int:
  """The route's ids per destination for ``requests`` of a routed table (static).

  ``plan.capacity_for`` the ids one device holds over all ``requests``
  (by member for a stack whose requests name theirs).
  """
  batch = requests[0].ids.shape[0]
  local = lambda r: -(-batch // plan.data_shards) * (r.ids.size // max(batch, 1))
  if plan.placement is not None and all(r.member is not None for r in requests):
    ids_by_member = {}
    for r in requests:
      ids_by_member[r.member] = ids_by_member.get(r.member, 0) + local(r)
    capacity = plan.capacity_for_members(ids_by_member)
  else:
    capacity = plan.capacity_for(sum(local(r) for r in requests))
  # An empty batch still sends its padding tokens (``pad_tokens``): XLA
  # rejects an all_to_all over a zero-size buffer.
  return max(capacity, 1)


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
  _no_stack(plan)
  pad_cols = plan.padded_shape[1] - query.shape[-1]
  if pad_cols:
    query = jnp.pad(query, [(0, 0)] * (query.ndim - 1) + [(0, pad_cols)])
  strategy = _STRATEGIES[plan.strategy]
  body = lambda t, q: strategy.attend(t, q, plan=plan)
  out = _run(body, table, query, plan=plan, mesh=mesh, fill=0)
  return out[..., : plan.num_embeddings]


def attend_vocab_split(table, query, *, plan, mesh):
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

  Returns:
    ``[tokens, ..., padded_vocab]``, laid out as ``vocab_split_spec``; the
    logits of padded rows are zero.
  """
  _no_stack(plan)
  tokens = query.shape[0]
  pad_cols = plan.padded_shape[1] - query.shape[-1]
  if pad_cols:  # a grid's padded columns
    query = jnp.pad(query, [(0, 0)] * (query.ndim - 1) + [(0, pad_cols)])
  token_spec = P(plan.data_axes or None)
  table_spec = P(*plan.table_spec)
  out_spec = vocab_split_spec(plan, query.ndim)
  query = sharding_lib.place(sharding_lib.pad_tokens(query, plan.data_shards, 0), mesh, token_spec)
  table = sharding_lib.place(table, mesh, table_spec)
  body = lambda t, q: _STRATEGIES[plan.strategy].local_logits(t, q, plan=plan)
  with no_context_mesh():
    out = _compat.shard_map(
        body, mesh=mesh, in_specs=(table_spec, token_spec), out_specs=out_spec
    )(table, query)
  if out.shape[0] != tokens:
    # Slicing a split dimension is not allowed on Explicit axes: gather the
    # (uneven) tokens, never the vocabulary.
    out = sharding_lib.place(out, mesh, P(None, *out_spec[1:]))[:tokens]
  return out


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
