"""Every layout's lookup over a mesh, as its two phases under the one runner.

A lookup is ``distribute`` (ids -> the state its layout needs) then
``finish`` (table + that state -> rows), the strategy modules' functions of
the same names. In line, ``runner.run`` runs both in one ``shard_map``
body: ``finish(table, distribute(ids))``. Run ahead (a pipelined step),
``distribute_rows`` runs the first in one program and keeps its state on
the devices (``runner.keep``), and ``finish_rows`` runs the second from it
in the next program, through the same functions.

Only lookups whose ids move before their rows do distribute ahead: a vocab
table's (ids gathered over the token axes) and a routed table's (ids
bucketed and sent to their owners). Replicated, hidden and grid tables'
ids don't move before the lookup, or move with the rows; they stay in
line (``distribute_rows`` returns None).
"""

from __future__ import annotations

from embedlib import options
from embedlib.strategies import early, grid, hidden, replicated, routed, rowmap, runner, vocab
from embedlib.strategies.request import Request

# Routed tables share vocab's layout: attend, and the lookups of a step whose
# route overflows, are vocab's.
STRATEGIES = {
    options.REPLICATED: replicated,
    options.VOCAB: vocab,
    options.HIDDEN: hidden,
    options.ROUTED: vocab,
    options.GRID: grid,
}


def routes(plan, mesh) -> bool:
  """Whether lookups of ``plan`` take the route (a routed table over several ranks)."""
  return plan.strategy == options.ROUTED and mesh is not None and plan.group_size > 1


def distributes(plan, mesh) -> bool:
  """Whether ``plan``'s lookups move ids before they read rows (vocab's layout)."""
  return mesh is not None and plan.strategy in (options.VOCAB, options.ROUTED)


def _tokens(request):
  """A request's token-split inputs and their padding values."""
  if request.pooled and request.weights is not None:
    return (request.ids, request.weights), (-1, 0)
  return (request.ids,), (-1,)


# -- one request of a replicated, vocab, hidden or grid table -------------------


def distribute_plain(request, *, plan, mesh, check_vma=True, table=None, gather=None,
                     early_fetch: float = 0.0) -> runner.PerDevice:
  """``request``'s distribution, kept on the devices for ``finish_plain``.

  With ``table`` (early fetch) and ids not pooled, the rows too
  (``vocab.fetch_early``), as ``table`` holds them now.
  """
  strategy = STRATEGIES[plan.strategy]
  fetch = table is not None and not request.pooled
  tokens, fill = _tokens(request)
  meta = ()
  if fetch:
    # The rows each token rank receives: its tokens' ids.
    block = -(-request.ids.shape[0] // plan.data_shards) * (
        request.ids.size // request.ids.shape[0])
    meta = (("corrections", early.correction_capacity(block, early_fetch)),)

  def body(tokens, table=None):
    state = strategy.distribute(*tokens, plan=plan, combiner=request.combiner)
    if table is not None:
      state = vocab.fetch_early(table, state, plan=plan, gather=gather)
    return state

  return runner.keep(body, tokens, fill, plan=plan, mesh=mesh, table=table if fetch else None,
                     meta=meta, check_vma=check_vma)


def finish_plain(table, request, state=None, *, plan, mesh, gather, bag, check_vma=True):
  """``request``'s rows: ``ids.shape + (features,)``, or ``[batch, features]`` pooled.

  ``state``: ``distribute_plain``'s, or None to distribute in line.
  """
  strategy = STRATEGIES[plan.strategy]
  run = dict(plan=plan, gather=gather, bag=bag, combiner=request.combiner)
  if state is None:
    body = lambda t, tokens: strategy.finish(
        t, strategy.distribute(*tokens, plan=plan, combiner=request.combiner), **run)
    tokens, fill = _tokens(request)
    return runner.run(body, table, tokens, fill, plan=plan, mesh=mesh, width=plan.features,
                      check_vma=check_vma)
  corrections = dict(state.meta).get("corrections")
  body = lambda t, _, leaves: strategy.finish(t, state.local(leaves), corrections=corrections,
                                              **run)
  return runner.run(body, table, (), (), plan=plan, mesh=mesh, state=state, like=request.ids,
                    width=plan.features, check_vma=check_vma)


# -- the requests of a routed table, routed together ------------------------------


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


def distribute_routed(requests, *, plan, mesh, check_vma=True, table=None, gather=None,
                      early_fetch: float = 0.0) -> runner.PerDevice:
  """The requests' ids bucketed and sent to their owners, kept for ``finish_routed``.

  With ``table`` (early fetch), the rows too: each owner's rows as
  ``table`` holds them now, sent back (``routed.send_ahead``).
  """
  capacity = route_capacity(requests, plan)
  ids = tuple(r.ids for r in requests)

  def body(ids, table=None):
    state = routed.distribute((rowmap.physical_ids(i, plan) for i in ids), plan=plan,
                              capacity=capacity)
    return routed.send_ahead(state, plan=plan, table=table, gather=gather)

  meta = () if table is None else (
      ("corrections", early.correction_capacity(capacity, early_fetch)),)
  return runner.keep(body, ids, (-1,) * len(ids), plan=plan, mesh=mesh, table=table, meta=meta,
                     check_vma=check_vma)


def finish_routed(table, requests, state=None, *, plan, mesh, gather, bag, check_vma=True,
                  fallback=True):
  """The requests of a routed table over several ranks, in one route.

  The route's capacity is ``route_capacity`` (static: the requests' shapes).

  Args:
    table: the physical table, ``plan.padded_shape``.
    requests: ``Request`` s sharing the batch (leading) dimension, ids
      ``-1`` for invalid.
    state: ``distribute_routed``'s, or None to distribute in line.
    plan: the table's ``EmbeddingPlan`` (``routes(plan, mesh)``).
    mesh: the mesh.
    gather: local row kernel.
    bag: local pooled kernel.
    check_vma: shard_map's type check (off for the Pallas interpreter).
    fallback: on overflow, the vocab path (else only report it).

  Returns:
    ``(outputs, need, capacity)``: one output per request; the largest
    bucket any group needed (int32 scalar); the capacity used.
  """
  capacity = route_capacity(requests, plan)
  ids = tuple(r.ids for r in requests)
  weights = tuple(r.weights for r in requests if r.weights is not None)
  corrections = None if state is None else dict(state.meta).get("corrections")

  def body(table, tokens, leaves=None):
    ids, weights = tokens
    weights = iter(weights)
    # A stack's logical rows to the physical rows its placement gives them.
    local = tuple(
        Request(rowmap.physical_ids(i, plan), next(weights) if r.weights is not None else None,
                r.combiner)
        for i, r in zip(ids, requests)
    )
    if leaves is None:
      got = routed.distribute(tuple(r.ids for r in local), plan=plan, capacity=capacity)
    else:
      got = state.local(leaves)
    out, need = routed.finish(table, local, got, plan=plan, gather=gather, bag=bag,
                              capacity=capacity, fallback=fallback, corrections=corrections)
    return out, need[None]

  out, need = runner.run(body, table, (ids, weights), ((-1,) * len(ids), (0,) * len(weights)),
                         plan=plan, mesh=mesh, state=state, width=plan.features, count=True,
                         check_vma=check_vma)
  return out, need, capacity


# -- every request of a table ----------------------------------------------------


def distribute_rows(requests, *, plan, mesh, check_vma=True, table=None, gather=None,
                    early_fetch: float = 0.0):
  """The requests' distribution for ``finish_rows``, or None where it stays in line.

  Args:
    requests: ``Request`` s of one table, sanitised ids (``-1`` invalid).
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh, or None.
    check_vma: shard_map's type check (off for the Pallas interpreter).
    table: the physical table, for ``early_fetch``.
    gather: the local row kernel, for ``early_fetch``.
    early_fetch: 0 for none, else the share (0, 1] of a route's slots (a
      vocab table's rows per token rank) that can carry corrected rows.

  Returns:
    A pytree of arrays (a ``PerDevice``, one per request outside a route),
    or None (see the module docstring).
  """
  if not distributes(plan, mesh):
    return None
  early_rows = dict(table=table if early_fetch else None, gather=gather,
                    early_fetch=early_fetch)
  if routes(plan, mesh):
    return distribute_routed(requests, plan=plan, mesh=mesh, check_vma=check_vma, **early_rows)
  return tuple(distribute_plain(r, plan=plan, mesh=mesh, check_vma=check_vma, **early_rows)
               for r in requests)


def finish_rows(table, requests, state=None, *, plan, mesh, gather, bag, check_vma=True):
  """Each request's rows: ``ids.shape + (features,)``, or ``[batch, features]`` pooled.

  ``state``: ``distribute_rows``'s, or None to distribute in line. A routed
  table's requests take one route, the vocab path on overflow.
  """
  run = dict(plan=plan, mesh=mesh, gather=gather, bag=bag, check_vma=check_vma)
  if routes(plan, mesh):
    out, _, _ = finish_routed(table, requests, state, fallback=True, **run)
    return out
  states = (None,) * len(requests) if state is None else state
  return tuple(finish_plain(table, r, s, **run) for r, s in zip(requests, states))


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
  (out,) = finish_rows(table, (Request(ids),), plan=plan, mesh=mesh, gather=gather, bag=None,
                       check_vma=check_vma)
  return out


def lookup_bag(table, ids, weights=None, *, plan, mesh, bag, combiner="sum", check_vma=True):
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
  (out,) = finish_rows(table, (Request(ids, weights, combiner),), plan=plan, mesh=mesh,
                       gather=None, bag=bag, check_vma=check_vma)
  return out
