"""The lookup ``ShardedEmbed`` asks for: plain, deduplicated or routed.

One entry point for every lookup of a table, returning the outputs and the
counts a caller checks when a static capacity may overflow
(``on_overflow="error"``): the distinct ids per shard against
``num_unique``, the ids per owner against the route capacity.
"""

from __future__ import annotations

import jax.numpy as jnp

from embedlib import options
from embedlib.strategies import dedup, sharded


def lookup_requests(table, requests, *, plan, mesh, gather, bag, check_vma=True,
                    num_unique: int | None = None, on_overflow: str = options.FALLBACK):
  """Every request of one table, looked up as the plan and the options say.

  Args:
    table: the physical table, ``plan.padded_shape``.
    requests: ``Request`` s sharing the batch dimension.
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
    out, overflow = lookup_requests(
        table, live, num_unique=num_unique, on_overflow=on_overflow, **run
    ) if live else ((), {})
    out = iter(out)
    return tuple(next(out) if r.ids.size else no_rows(r, plan, mesh, table.dtype)
                 for r in requests), overflow
  if num_unique is not None:
    out, need = dedup.lookup_requests(
        table, requests, capacity=num_unique, on_overflow=on_overflow, **run
    )
    return out, {"num_unique": (need, num_unique)}
  if plan.strategy == options.ROUTED:
    out, need, capacity = sharded.routed_requests(
        table, requests, fallback=on_overflow == options.FALLBACK, **run
    )
    return out, {"route_capacity": (need, capacity)}
  return sharded.lookup_requests(table, requests, **run), {}


def no_rows(request, plan, mesh, dtype):
  """The zeros a request without ids looks up, split like its ids (as a lookup returns them)."""
  # Made from the ids, so their split carries over without a reshard, which
  # jit rejects on Explicit axes outside a mesh context.
  base = jnp.asarray(request.ids).astype(dtype)[..., None] * 0
  if request.pooled:
    base = jnp.sum(base, axis=1)
  return jnp.broadcast_to(base, base.shape[:-1] + (plan.features,))
