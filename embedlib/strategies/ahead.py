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

  def local(self, leaves):
    """The body's values from this device's ``leaves`` (inside ``shard_map``)."""
    return jax.tree.unflatten(self.treedef, [x[0] for x in leaves])


def _per_device(body, args, in_specs, *, mesh, check_vma) -> PerDevice:
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
  return PerDevice(tuple(leaves), specs, treedef)


def _routes(plan, mesh) -> bool:
  return sharded._routes(plan, mesh)  # pylint: disable=protected-access


def _distributes(plan, mesh) -> bool:
  """Whether ``plan``'s lookups move ids before they read rows (vocab's layout)."""
  return mesh is not None and plan.strategy in (options.VOCAB, options.ROUTED)


def distribute(requests, *, plan, mesh, num_unique: int | None = None, check_vma=True):
  """The ids' distribution of a lookup of ``requests``: what needs no table.

  Args:
    requests: ``Request`` s of one table, sanitised ids (``-1`` invalid),
      as ``dispatch.lookup_requests`` takes them.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh, or None.
    num_unique: the dedup capacity the lookup will use, or None.
    check_vma: shard_map's type check (off for the Pallas interpreter).

  Returns:
    A pytree of arrays for ``lookup_distributed``, or None where the lookup
    has nothing to distribute ahead (see the module docstring).
  """
  if not _distributes(plan, mesh) or any(r.ids.size == 0 for r in requests):
    return None
  if num_unique is not None:
    batch = requests[0].ids.shape[0]
    ids = sharding_lib.pad_tokens(
        jnp.concatenate([dedup.as_2d(r.ids) for r in requests], axis=1), plan.data_shards, -1)
    unique, inverse, counts = dedup.unique_per_shard(ids, num_unique, plan=plan, mesh=mesh)
    del batch
    return {"unique": unique, "inverse": inverse, "counts": counts,
            "rows": _plain_distribute((Request(unique),), plan=plan, mesh=mesh,
                                      check_vma=check_vma)}
  return _plain_distribute(requests, plan=plan, mesh=mesh, check_vma=check_vma)


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


def _plain_distribute(requests, *, plan, mesh, check_vma):
  if _routes(plan, mesh):
    return _routed_distribute(requests, plan=plan, mesh=mesh, check_vma=check_vma)
  return tuple(_vocab_distribute(r, plan=plan, mesh=mesh, check_vma=check_vma)
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


def _vocab_distribute(request, *, plan, mesh, check_vma):
  """``vocab.lookup`` / ``bag_lookup``'s input step: the ids gathered over the token axes."""
  pooled, has_weights = request.pooled, request.weights is not None
  args = (_token_split(request.ids, plan, mesh, -1),)
  if has_weights:
    args += (_token_split(request.weights, plan, mesh, 0),)

  def body(ids, weights=None):
    ids = collectives.gather_tokens(ids, plan.token_axes)
    if not pooled:
      return {"ids": ids}
    if weights is not None:
      weights = collectives.gather_tokens(weights, plan.token_axes)
    return {"ids": ids, "coef": reference.bag_coefficients(ids, weights, plan.num_embeddings,
                                                            request.combiner)}

  return _per_device(body, args, (P(plan.data_axes or None),) * len(args), mesh=mesh,
                     check_vma=check_vma)


def _vocab_finish(table, requests, distributed, *, plan, mesh, gather, bag, check_vma):
  """``sharded.lookup`` / ``lookup_bag`` (vocab's body) of each request."""
  table_spec, token_spec = P(*plan.table_spec), P(plan.data_axes or None)
  table = sharding_lib.place(table, mesh, table_spec)
  outs = []
  for r, d in zip(requests, distributed):
    def body(table, leaves, d=d, pooled=r.pooled):
      got = d.local(leaves)
      owned = vocab._owned(got["ids"], table.shape[0], plan)  # pylint: disable=protected-access
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


def _routed_distribute(requests, *, plan, mesh, check_vma):
  """``routed.lookup_requests``'s input distribution: bucketing and ``send_ids``."""
  capacity = sharded.route_capacity(requests, plan)
  rows_per_rank = plan.padded_shape[0] // plan.group_size
  ids = tuple(_token_split(r.ids, plan, mesh, -1) for r in requests)

  def body(ids):
    flat = jnp.concatenate([rowmap.physical_ids(i, plan).reshape(-1) for i in ids])
    mine = routed._my_slice(flat.astype(jnp.int32), plan.rest_axes)  # pylint: disable=protected-access
    send, slot, need = routed.bucketize(mine, rows_per_rank, plan.group_size, capacity)
    need = lax.pmax(need, plan.table_axes)
    return {"received": routed.send_ids(send, plan=plan), "slot": slot, "need": need}

  return _per_device(body, (ids,), (P(plan.data_axes or None),), mesh=mesh,
                     check_vma=check_vma)


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
                             capacity=capacity, fallback=fallback)
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


def _routed_rows(table, requests, got, *, plan, gather, bag, capacity, fallback):
  """``routed.lookup_requests`` after its ``send_ids``: the owners' lookup, rows back."""
  flat = jnp.concatenate([r.ids.reshape(-1) for r in requests]).astype(jnp.int32)
  slot, need = got["slot"], got["need"]
  vary_like = routed._vary_like  # pylint: disable=protected-access

  def routed_():
    back = routed.rows_back(gather(table, got["received"]), plan=plan)
    if plan.rest_axes:
      rows = gather(back, slot)
      rows = collectives._gather_rest(rows, plan.rest_axes, 0)[: flat.shape[0]]  # pylint: disable=protected-access
      index = jnp.where(flat >= 0, jnp.arange(flat.shape[0], dtype=jnp.int32), -1)
    else:
      rows, index = back, slot
    outs, start = [], 0
    for r in requests:
      part = lax.slice_in_dim(index, start, start + r.ids.size).reshape(r.ids.shape)
      start += r.ids.size
      if r.pooled:
        coef = reference.bag_coefficients(r.ids, r.weights, plan.padded_shape[0], r.combiner)
        outs.append(bag(rows, part, coef, combiner="sum"))
      else:
        outs.append(gather(rows, part))
    return tuple(vary_like(o, flat) for o in outs)

  def unrouted():
    return tuple(
        vary_like(
            vocab.bag_lookup(table, r.ids, r.weights, plan=plan, bag=bag, combiner=r.combiner)
            if r.pooled else vocab.lookup(table, r.ids, plan=plan, gather=gather),
            flat,
        )
        for r in requests
    )

  if not fallback:
    return routed_(), need
  return lax.cond(need > capacity, unrouted, routed_), need


# -- dedup ---------------------------------------------------------------------


def _dedup_finish(table, requests, distributed, *, plan, mesh, gather, bag, capacity,
                  on_overflow, check_vma):
  """``dedup.lookup_requests`` from the distinct ids and their rows' distribution."""
  batch = requests[0].ids.shape[0]
  need = jnp.max(distributed["counts"])
  coefs = tuple(
      sharding_lib.pad_tokens(
          reference.bag_coefficients(r.ids, r.weights, plan.num_embeddings, r.combiner),
          plan.data_shards, 0,
      ) if r.pooled else None
      for r in requests
  )
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
