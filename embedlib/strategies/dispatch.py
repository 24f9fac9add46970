"""The lookup ``ShardedEmbed`` asks for: plain, deduplicated or routed, in line or ahead.

One entry point for every lookup of a table. ``lookup_requests`` runs it
in line; a pipelined step runs its two phases in two programs:
``distribute`` (what needs the ids alone) a step ahead, then ``finish``
(``lookup_requests`` from that state), through the same functions. Each
returns, beside the outputs, the counts a caller checks when a static
capacity may overflow (``on_overflow="error"``): the distinct ids per shard
against ``num_unique``, the ids per owner against the route capacity.

Early fetch (``distribute(..., early_fetch=)``): a routed or vocab table's
rows are read and sent to the ranks that hold their tokens with the ids,
before the step that precedes their own updates the table. ``finish`` then
reads each owner's rows again, compares their bits with the ones it sent,
and sends the changed rows with their slots, which overwrite the early ones
(``routed.rows_up_to_date``, ``vocab.rows_up_to_date``): the rows are the
table's current rows bit for bit, unlike a semi-synchronous pipeline that
uses them stale. Pooled vocab lookups without dedup are read in line: a
bag's sum over its ids' owners can't be rebuilt bit for bit from per-id
rows.

What stays in line (``distribute`` returns None): tables without a mesh,
replicated, hidden and grid tables (their ids don't move before the
lookup, or move with the rows), requests without ids, and the fallback
branches taken on a step that overflows a route or dedup capacity.
"""

from __future__ import annotations

import jax.numpy as jnp

from embedlib import options
from embedlib.strategies import dedup, sharded
from embedlib.strategies.request import Request


def distribute(requests, *, plan, mesh, num_unique: int | None = None, check_vma=True,
               table=None, gather=None, early_fetch: float = 0.0):
  """The first phase of a lookup of ``requests``, run ahead: what needs no table.

  With ``early_fetch``, a routed or vocab table's rows are fetched too
  (not a vocab table's pooled bags), from ``table`` as it is now;
  ``finish`` brings the rows the table has changed since up to date.

  Args:
    requests: ``Request`` s of one table, sanitised ids (``-1`` invalid),
      as ``lookup_requests`` takes them.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh, or None.
    num_unique: the dedup capacity the lookup will use, or None.
    check_vma: shard_map's type check (off for the Pallas interpreter).
    table: the physical table, for ``early_fetch``.
    gather: the local row kernel, for ``early_fetch``.
    early_fetch: 0 for none, else the share (0, 1] of a route's slots (a
      vocab table's rows per token rank) that can carry corrected rows
      (``early.correction_capacity``).

  Returns:
    A pytree of arrays for ``finish``, or None where the lookup has nothing
    to distribute ahead (see the module docstring).
  """
  if not sharded.distributes(plan, mesh) or any(r.ids.size == 0 for r in requests):
    return None
  if early_fetch and table is None:
    raise ValueError(f"{plan.name}: early_fetch needs the table and gather kernel.")
  rows = dict(plan=plan, mesh=mesh, check_vma=check_vma, table=table, gather=gather,
              early_fetch=early_fetch)
  if num_unique is not None:
    state = dedup.distribute(requests, plan=plan, mesh=mesh, capacity=num_unique)
    return {**state, "rows": sharded.distribute_rows((Request(state["unique"]),), **rows)}
  return sharded.distribute_rows(requests, **rows)


def finish(table, requests, distributed, *, plan, mesh, gather, bag, check_vma=True,
           num_unique: int | None = None, on_overflow: str = options.FALLBACK):
  """Every request of one table, looked up as the plan and the options say.

  Args:
    table: the physical table, ``plan.padded_shape``.
    requests: ``Request`` s sharing the batch dimension.
    distributed: ``distribute``'s result for these requests (and
      ``num_unique``), or None to distribute in line.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh, or None.
    gather: local row kernel.
    bag: local pooled kernel.
    check_vma: shard_map's type check (off for the Pallas interpreter).
    num_unique: dedup capacity per data shard, or None (see ``dedup``). On
      a routed table the distinct ids are what is routed.
    on_overflow: ``"fallback"`` or ``"error"``. With ``num_unique`` on a
      routed table it governs the dedup capacity; the route of the distinct
      ids then always falls back, so no step is lost.

  Returns:
    ``(outputs, overflow)``: one output per request; ``{capacity name:
    (need, capacity)}`` for the caller's check in ``"error"`` mode.
  """
  run = dict(plan=plan, mesh=mesh, gather=gather, bag=bag, check_vma=check_vma)
  if any(r.ids.size == 0 for r in requests):
    # A request without ids reads no row: its output is zeros, and it never
    # reaches a shard_map, where empty operands fail (on Auto axes Shardy
    # rejects a routed lookup of them; XLA a zero-size all_to_all).
    live = tuple(r for r in requests if r.ids.size)
    out, overflow = finish(
        table, live, distributed, num_unique=num_unique, on_overflow=on_overflow, **run
    ) if live else ((), {})
    out = iter(out)
    return tuple(next(out) if r.ids.size else no_rows(r, plan, mesh, table.dtype)
                 for r in requests), overflow
  if num_unique is not None:
    state = distributed
    if state is None:
      state = dedup.distribute(requests, plan=plan, mesh=mesh, capacity=num_unique)
    out, need = dedup.finish(
        table, requests, state, capacity=num_unique, on_overflow=on_overflow,
        lookup_unique=lambda t, s: sharded.finish_rows(t, (Request(s["unique"]),), s["rows"],
                                                       **run)[0],
        lookup_all=lambda t: sharded.finish_rows(t, requests, **run), **run)
    return out, {"num_unique": (need, num_unique)}
  if plan.strategy == options.ROUTED:
    if not sharded.routes(plan, mesh):  # one owner: nothing to route
      return sharded.finish_rows(table, requests, distributed, **run), {
          "route_capacity": (jnp.int32(0), 0)}
    out, need, capacity = sharded.finish_routed(
        table, requests, distributed, fallback=on_overflow == options.FALLBACK, **run)
    return out, {"route_capacity": (need, capacity)}
  return sharded.finish_rows(table, requests, distributed, **run), {}


def lookup_requests(table, requests, *, plan, mesh, gather, bag, check_vma=True,
                    num_unique: int | None = None, on_overflow: str = options.FALLBACK):
  """``finish`` distributing in line: the lookup of a step that runs nothing ahead."""
  return finish(table, requests, None, plan=plan, mesh=mesh, gather=gather, bag=bag,
                check_vma=check_vma, num_unique=num_unique, on_overflow=on_overflow)


def no_rows(request, plan, mesh, dtype):
  """The zeros a request without ids looks up, split like its ids (as a lookup returns them)."""
  # Made from the ids, so their split carries over without a reshard, which
  # jit rejects on Explicit axes outside a mesh context.
  base = jnp.asarray(request.ids).astype(dtype)[..., None] * 0
  if request.pooled:
    base = jnp.sum(base, axis=1)
  return jnp.broadcast_to(base, base.shape[:-1] + (plan.features,))
