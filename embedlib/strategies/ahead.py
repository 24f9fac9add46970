"""A lookup split where the table enters: the ids' distribution, then the rows.

Every lookup of a row-sharded table first moves ids and only then reads
rows: a routed table buckets each device's ids by owner and sends them
(``routed.send_ids``, an all_to_all), a vocab table all-gathers them over
its token axes, and a deduplicating lookup sorts each shard's ids first.
That part depends on the ids alone. ``distribute`` runs it and returns its
result (a pytree of arrays); ``lookup_distributed`` runs the rest from it
with the operations the lookup in line runs (``dispatch.lookup_requests``),
so its outputs are the same bit for bit. A pipelined train step distributes
batch N+1 inside step N's program, where nothing ties it to step N's loss.

Early fetch (``early_fetch``): a routed or vocab table's rows are read and
sent to the ranks that hold their tokens with the ids, before the step that
precedes their own updates the table. The lookup then reads each owner's
rows again, compares their bits with the ones it sent, and sends the
changed rows with their slots, which overwrite the early ones
(``_brought_up_to_date``, ``_vocab_brought_up_to_date``): the rows are the
table's current rows bit for bit, unlike a semi-synchronous pipeline that
uses them stale. A vocab row is its owner's row plus the other ranks'
zeros, so the early rows are the in-line lookup's, and a corrected one is
its owner's new row (with -0.0 made 0.0, as that sum makes it). Pooled
vocab lookups without dedup are read in line: a bag's sum over its ids'
owners can't be rebuilt bit for bit from per-id rows.

What stays in line (``distribute`` returns None): tables without a mesh,
replicated, hidden and grid tables (their ids don't move before the
lookup, or move with the rows), requests without ids, and the fallback
branches taken on a step that overflows a route or dedup capacity.

The bodies below mirror ``routed.lookup_requests``, ``sharded.lookup`` /
``lookup_bag`` and ``dedup.lookup_requests`` step for step; the pipeline's
tests compare them with those bit for bit.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from embedlib import _compat
from embedlib import options
from embedlib import sharding as sharding_lib
from embedlib.kernels import reference
from embedlib.strategies import collectives, dedup, dispatch, routed, rowmap, sharded, vocab
from embedlib.strategies.request import Request

# The routed and vocab lookups' own steps, which the split lookup runs unchanged.
# pylint: disable=protected-access
_my_slice = routed._my_slice
_owned = vocab._owned
_gather_rest = collectives._gather_rest
# pylint: enable=protected-access


@struct.dataclass
class PerDevice:
  """Values made inside ``shard_map``, kept per device between two programs.

  Each leaf is ``[devices along the axes it varies over, ...]``, split over
  those axes (``specs``), so a later ``shard_map`` hands every device back
  its own value, typed as varying over the same axes.
  """

  leaves: tuple
  specs: tuple = struct.field(pytree_node=False)
  treedef: tp.Any = struct.field(pytree_node=False)
  meta: tuple = struct.field(pytree_node=False, default=())

  def local(self, leaves):
    """The body's values from this device's ``leaves`` (inside ``shard_map``)."""
    return jax.tree.unflatten(self.treedef, [x[0] for x in leaves])


def _per_device(body, args, in_specs, *, mesh, check_vma, meta=()) -> PerDevice:
  """Runs ``body(*args)`` over ``mesh``; keeps its outputs per device."""
  axes = tuple(mesh.axis_names)
  found = []

  def probe(*a):
    leaves, treedef = jax.tree.flatten(body(*a))
    varying = [sharding_lib.varying_axes(x) if check_vma else frozenset(axes) for x in leaves]
    found.append((tuple(tuple(n for n in axes if n in v) for v in varying), treedef))
    return tuple(x[None] for x in leaves)

  with sharded.no_context_mesh():
    # Traced once for the axes each output varies over (no computation).
    jax.eval_shape(_compat.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=P(axes),
                                     check_vma=check_vma), *args)
    varying, treedef = found[-1]
    specs = tuple(P(v or None) for v in varying)
    leaves = _compat.shard_map(
        lambda *a: tuple(x[None] for x in jax.tree.leaves(body(*a))), mesh=mesh,
        in_specs=in_specs, out_specs=specs, check_vma=check_vma,
    )(*args)
  return PerDevice(tuple(leaves), specs, treedef, meta)


def _routes(plan, mesh) -> bool:
  return sharded._routes(plan, mesh)  # pylint: disable=protected-access


def _distributes(plan, mesh) -> bool:
  """Whether ``plan``'s lookups move ids before they read rows (vocab's layout)."""
  return mesh is not None and plan.strategy in (options.VOCAB, options.ROUTED)


def distribute(requests, *, plan, mesh, num_unique: int | None = None, check_vma=True,
               table=None, gather=None, early_fetch: float = 0.0):
  """The ids' distribution of a lookup of ``requests``: what needs no table.

  With ``early_fetch``, a routed or vocab table's rows are fetched too
  (not a vocab table's pooled bags), from ``table`` as it is now;
  ``lookup_distributed`` brings the rows the table has changed since up to
  date.

  Args:
    requests: ``Request`` s of one table, sanitised ids (``-1`` invalid),
      as ``dispatch.lookup_requests`` takes them.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh, or None.
    num_unique: the dedup capacity the lookup will use, or None.
    check_vma: shard_map's type check (off for the Pallas interpreter).
    table: the physical table, for ``early_fetch``.
    gather: the local row kernel, for ``early_fetch``.
    early_fetch: 0 for none, else the share (0, 1] of a route's slots (a
      vocab table's rows per token rank) that can carry corrected rows
      (``correction_capacity``).

  Returns:
    A pytree of arrays for ``lookup_distributed``, or None where the lookup
    has nothing to distribute ahead (see the module docstring).
  """
  if not _distributes(plan, mesh) or any(r.ids.size == 0 for r in requests):
    return None
  if early_fetch and table is None:
    raise ValueError(f"{plan.name}: early_fetch needs the table and gather kernel.")
  early = dict(table=table, gather=gather, early_fetch=early_fetch)
  if num_unique is not None:
    ids = sharding_lib.pad_tokens(
        jnp.concatenate([dedup.as_2d(r.ids) for r in requests], axis=1), plan.data_shards, -1)
    unique, inverse, counts = dedup.unique_per_shard(ids, num_unique, plan=plan, mesh=mesh)
    return {"unique": unique, "inverse": inverse, "counts": counts,
            "rows": _plain_distribute((Request(unique),), plan=plan, mesh=mesh,
                                      check_vma=check_vma, **early)}
  return _plain_distribute(requests, plan=plan, mesh=mesh, check_vma=check_vma, **early)


def lookup_distributed(table, requests, distributed, *, plan, mesh, gather, bag,
                       check_vma=True, num_unique: int | None = None,
                       on_overflow: str = options.FALLBACK):
  """``dispatch.lookup_requests`` from the ids' distribution ``distribute`` made.

  ``distributed`` must be ``distribute``'s result for these requests' ids
  (and ``num_unique``); None looks them up in line.

  Returns:
    ``(outputs, overflow)`` as ``dispatch.lookup_requests`` returns them.
  """
  run = dict(plan=plan, mesh=mesh, gather=gather, bag=bag, check_vma=check_vma)
  if distributed is None:
    return dispatch.lookup_requests(table, requests, num_unique=num_unique,
                                    on_overflow=on_overflow, **run)
  if num_unique is not None:
    out, need = _dedup_finish(table, requests, distributed, capacity=num_unique,
                              on_overflow=on_overflow, **run)
    return out, {"num_unique": (need, num_unique)}
  if _routes(plan, mesh):
    out, need, capacity = _routed_finish(table, requests, distributed,
                                         fallback=on_overflow == options.FALLBACK, **run)
    return out, {"route_capacity": (need, capacity)}
  return _vocab_finish(table, requests, distributed, **run), {}


# -- without dedup: routed and vocab -------------------------------------------


def _plain_distribute(requests, *, plan, mesh, check_vma, table, gather, early_fetch):
  if _routes(plan, mesh):
    return _routed_distribute(requests, plan=plan, mesh=mesh, check_vma=check_vma,
                              table=table if early_fetch else None, gather=gather,
                              early_fetch=early_fetch)
  return tuple(_vocab_distribute(r, plan=plan, mesh=mesh, check_vma=check_vma,
                                 table=table if early_fetch else None, gather=gather,
                                 early_fetch=early_fetch)
               for r in requests)


def _plain_finish(table, requests, distributed, *, plan, mesh, gather, bag, check_vma):
  """``sharded.lookup_requests`` from ``_plain_distribute``'s result."""
  run = dict(plan=plan, mesh=mesh, gather=gather, bag=bag, check_vma=check_vma)
  if _routes(plan, mesh):
    out, _, _ = _routed_finish(table, requests, distributed, fallback=True, **run)
    return out
  return _vocab_finish(table, requests, distributed, **run)


def _token_split(x, plan, mesh, fill):
  return sharding_lib.place(sharding_lib.pad_tokens(x, plan.data_shards, fill), mesh,
                            P(plan.data_axes or None))


def _vocab_distribute(request, *, plan, mesh, check_vma, table=None, gather=None,
                      early_fetch=0.0):
  """``vocab.lookup`` / ``bag_lookup``'s input step: the ids gathered over the token axes.

  With ``table`` (early fetch) and ids not pooled, the rows too: each
  rank's partial rows as ``table`` holds them now (``stale``, kept where
  they were read) and their sum at the ranks that hold the tokens
  (``rows``), which is the in-line lookup of this table. Pooled bags are
  read in line: a bag's sum over its ids' owners can't be rebuilt bit for
  bit from per-id rows (the owners' partial sums and their psum add in
  another order), and a bag with one changed id needs every owner again.
  """
  pooled, has_weights = request.pooled, request.weights is not None
  early = table is not None and not pooled
  args = (_token_split(request.ids, plan, mesh, -1),)
  if has_weights:
    args += (_token_split(request.weights, plan, mesh, 0),)
  specs = (P(plan.data_axes or None),) * len(args)
  meta = ()
  if early:
    table_spec = P(*plan.table_spec)
    args += (sharding_lib.place(table, mesh, table_spec),)
    specs += (table_spec,)
    # The rows each token rank receives: its tokens' ids.
    block = args[0].size // plan.data_shards
    meta = (("corrections", correction_capacity(block, early_fetch)),)

  def body(ids, *rest):
    table = rest[-1] if early else None
    weights = rest[0] if has_weights else None
    ids = collectives.gather_tokens(ids, plan.token_axes)
    if not pooled:
      if table is None:
        return {"ids": ids}
      stale = gather(table, _owned(ids, table.shape[0], plan))
      return {"ids": ids, "stale": stale,
              "rows": collectives.sum_partials(stale, plan.token_axes, plan.rest_axes)}
    if weights is not None:
      weights = collectives.gather_tokens(weights, plan.token_axes)
    return {"ids": ids, "coef": reference.bag_coefficients(ids, weights, plan.num_embeddings,
                                                            request.combiner)}

  return _per_device(body, args, specs, mesh=mesh, check_vma=check_vma, meta=meta)


def _vocab_brought_up_to_date(table, got, corrections, *, plan, gather):
  """The early rows with every row the table has changed since replaced: the in-line lookup exactly.

  Each rank reads the rows it owns of the gathered ids again and compares
  their bits with what it read before (``stale``); the changed ones (at
  most ``corrections`` per token rank) go to the token ranks that hold
  those tokens (an all_to_all over the token axes, then gathered over the
  rest axes, whose ranks hold the same tokens) and replace the early rows
  there. A step with more changed rows for one token rank than that sums
  every rank's rows again (``sum_partials``), as the in-line lookup does.
  """
  token_axes, rest_axes = plan.token_axes, plan.rest_axes
  fresh = gather(table, _owned(got["ids"], table.shape[0], plan))
  rows = got["rows"]
  features = rows.shape[-1]
  ranks = fresh.shape[0] // rows.shape[0]  # along the token axes
  block = rows.size // features  # rows each token rank receives
  width = np.dtype(fresh.dtype).itemsize * 8
  bits = lambda x: lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}"))
  # A row no rank owns (an invalid id) reads zeros both times: never changed.
  changed = jnp.any(bits(fresh) != bits(got["stale"]), axis=-1).reshape(ranks, block)
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
      values = _gather_rest(values, rest_axes, 0)
      slots = _gather_rest(slots, rest_axes, 0)
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


def _vocab_finish(table, requests, distributed, *, plan, mesh, gather, bag, check_vma):
  """``sharded.lookup`` / ``lookup_bag`` (vocab's body) of each request."""
  table_spec, token_spec = P(*plan.table_spec), P(plan.data_axes or None)
  table = sharding_lib.place(table, mesh, table_spec)
  outs = []
  for r, d in zip(requests, distributed):
    def body(table, leaves, d=d, pooled=r.pooled):
      got = d.local(leaves)
      if "rows" in got:  # fetched a step early
        return _vocab_brought_up_to_date(table, got, dict(d.meta)["corrections"], plan=plan,
                                         gather=gather)
      owned = _owned(got["ids"], table.shape[0], plan)
      if pooled:
        rows = bag(table, owned, got["coef"], combiner="sum")
      else:
        rows = gather(table, owned)
      return collectives.sum_partials(rows, plan.token_axes, plan.rest_axes)

    with sharded.no_context_mesh():
      out = _compat.shard_map(body, mesh=mesh, in_specs=(table_spec, d.specs),
                              out_specs=token_spec, check_vma=check_vma)(table, d.leaves)
    tokens = r.ids.shape[0]
    out = sharding_lib.restore_tokens(out, tokens, mesh, sharding_lib.leading_spec(r.ids, mesh))
    outs.append(out[..., : plan.features])
  return tuple(outs)


def _routed_distribute(requests, *, plan, mesh, check_vma, table=None, gather=None,
                       early_fetch=0.0):
  """``routed.lookup_requests``'s input distribution: bucketing and ``send_ids``.

  With ``table``, the rows too (early fetch): each owner's rows as ``table``
  holds them now (``stale``, kept at the owner) and sent back (``rows``).
  """
  capacity = sharded.route_capacity(requests, plan)
  rows_per_rank = plan.padded_shape[0] // plan.group_size
  ids = tuple(_token_split(r.ids, plan, mesh, -1) for r in requests)
  token_spec, table_spec = P(plan.data_axes or None), P(*plan.table_spec)

  def body(ids, table=None):
    flat = jnp.concatenate([rowmap.physical_ids(i, plan).reshape(-1) for i in ids])
    mine = _my_slice(flat.astype(jnp.int32), plan.rest_axes)
    send, slot, need = routed.bucketize(mine, rows_per_rank, plan.group_size, capacity)
    need = lax.pmax(need, plan.table_axes)
    got = {"received": routed.send_ids(send, plan=plan), "slot": slot, "need": need}
    if table is not None:
      got["stale"] = gather(table, routed.asked(got["received"]))
      got["rows"] = routed.rows_back(got["stale"], plan=plan, sent=got["received"])
    return got

  if table is None:
    return _per_device(body, (ids,), (token_spec,), mesh=mesh, check_vma=check_vma)
  table = sharding_lib.place(table, mesh, table_spec)
  corrections = correction_capacity(capacity, early_fetch)
  return _per_device(body, (ids, table), (token_spec, table_spec), mesh=mesh,
                     check_vma=check_vma, meta=(("corrections", corrections),))


def correction_capacity(capacity: int, early_fetch: float) -> int:
  """Corrected rows each owner can send each rank: ``early_fetch`` of the route's slots.

  >>> correction_capacity(40, 0.25), correction_capacity(3, 0.01)
  (10, 1)
  """
  return max(1, min(capacity, int(np.ceil(capacity * early_fetch))))


def _brought_up_to_date(table, got, corrections, *, plan, gather):
  """The early rows with every row the table has changed since replaced: ``rows_back`` exactly.

  Each owner reads its asked rows again and compares their bits with what
  it sent (``stale``); the changed ones (at most ``corrections`` per asking
  rank) go out with their slots and overwrite the early rows there. A step
  with more changed rows for one rank than that sends every row again.
  """
  fresh = gather(table, routed.asked(got["received"]))
  if plan.node_route:
    # The corrections' exchange is the flat route's (a changed row goes
    # straight to the rank that asked); the two-level route's rows come back
    # deduplicated per node, so there every row is sent again: still exact.
    return routed.rows_back(fresh, plan=plan, sent=got["received"])
  group = plan.group_size
  capacity = fresh.shape[0] // group
  width = np.dtype(fresh.dtype).itemsize * 8
  bits = lambda x: lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}"))
  changed = jnp.any(bits(fresh) != bits(got["stale"]), axis=-1).reshape(group, capacity)
  need = lax.pmax(jnp.max(jnp.sum(changed, axis=1, dtype=jnp.int32)), plan.table_axes)
  exchange = lambda x: lax.all_to_all(x, plan.table_axes, 0, 0, tiled=True)

  def corrected():
    # The changed slots first in each asking rank's block, in slot order.
    order = jnp.argsort(~changed, axis=1, stable=True)[:, :corrections].astype(jnp.int32)
    kept = jnp.take_along_axis(changed, order, axis=1)
    block = jnp.arange(group, dtype=jnp.int32)[:, None] * capacity
    values = jnp.take(fresh, (block + order).reshape(-1), axis=0)
    slots = exchange(jnp.where(kept, block + order, -1).reshape(-1))
    values = exchange(values)
    # Back home, a slot of owner b's block is b * capacity + its place there.
    n = jnp.arange(group * corrections, dtype=jnp.int32)
    # Unused entries each point past the end at a place of their own.
    at = jnp.where(slots >= 0, n // corrections * capacity + slots % capacity,
                   group * capacity + n)
    return got["rows"].at[at].set(values, mode="drop", unique_indices=True)

  def refetch():
    return routed.rows_back(fresh, plan=plan)

  return lax.cond(need > corrections, refetch, corrected)


def _routed_finish(table, requests, distributed, *, plan, mesh, gather, bag, check_vma,
                   fallback):
  """``sharded.routed_requests`` with the ids already at their owners."""
  capacity = sharded.route_capacity(requests, plan)
  batch = requests[0].ids.shape[0]
  spec = sharding_lib.leading_spec(requests[0].ids, mesh)
  token_spec, table_spec = P(plan.data_axes or None), P(*plan.table_spec)
  ids = tuple(_token_split(r.ids, plan, mesh, -1) for r in requests)
  weights = tuple(_token_split(r.weights, plan, mesh, 0)
                  for r in requests if r.weights is not None)
  table = sharding_lib.place(table, mesh, table_spec)
  d = distributed

  def body(table, ids, weights, leaves):
    weights = iter(weights)
    local = tuple(
        Request(rowmap.physical_ids(i, plan), next(weights) if r.weights is not None else None,
                r.combiner)
        for i, r in zip(ids, requests)
    )
    out, need = _routed_rows(table, local, d.local(leaves), plan=plan, gather=gather, bag=bag,
                             capacity=capacity, fallback=fallback,
                             corrections=dict(d.meta).get("corrections"))
    return out, need[None]

  with sharded.no_context_mesh():
    out, need = _compat.shard_map(
        body, mesh=mesh, in_specs=(table_spec, token_spec, token_spec, d.specs),
        out_specs=((token_spec,) * len(requests), token_spec), check_vma=check_vma,
    )(table, ids, weights, d.leaves)
  out = tuple(
      sharding_lib.restore_tokens(o, batch, mesh, spec)[..., : plan.features] for o in out
  )
  return out, jnp.max(need), capacity


def _routed_rows(table, requests, got, *, plan, gather, bag, capacity, fallback,
                 corrections=None):
  """``routed.lookup_requests`` after its ``send_ids``: the owners' lookup, rows back."""

  def rows_back_here():
    if "rows" in got:  # fetched a step early
      return _brought_up_to_date(table, got, corrections, plan=plan, gather=gather)
    sent = got["received"]
    return routed.rows_back(gather(table, routed.asked(sent)), plan=plan, sent=sent)

  return routed.outputs(table, requests, got["slot"], got["need"], rows_back_here, plan=plan,
                        gather=gather, bag=bag, capacity=capacity, fallback=fallback)


# -- dedup ---------------------------------------------------------------------


def _dedup_finish(table, requests, distributed, *, plan, mesh, gather, bag, capacity,
                  on_overflow, check_vma):
  """``dedup.lookup_requests`` from the distinct ids and their rows' distribution."""
  batch = requests[0].ids.shape[0]
  need = jnp.max(distributed["counts"])
  coefs = dedup.coefficients(requests, plan)
  widths = [dedup.as_2d(r.ids).shape[1] for r in requests]
  specs = [sharding_lib.leading_spec(r.ids, mesh) for r in requests]
  run = dict(plan=plan, mesh=mesh, gather=gather, bag=bag, check_vma=check_vma)

  def with_dedup(table, d, coefs):
    (rows,) = _plain_finish(table, (Request(d["unique"]),), d["rows"], **run)
    parts = jnp.split(d["inverse"], np.cumsum(widths)[:-1], axis=1)
    parts = [p[:, 0] if r.ids.ndim == 1 else p for p, r in zip(parts, requests)]
    out = dedup.rebuild(rows, parts, coefs, **run)
    return tuple(sharding_lib.restore_tokens(o, batch, mesh, spec) for o, spec in zip(out, specs))

  def without_dedup(table, d, coefs):
    del d, coefs
    return sharded.lookup_requests(table, requests, **run)

  if on_overflow == dedup.ERROR:
    return with_dedup(table, distributed, coefs), need
  return lax.cond(need > capacity, without_dedup, with_dedup, table, distributed, coefs), need
