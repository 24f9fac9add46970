"""Owner-routed row sharding: each id goes to the rank owning its row, the row comes back.

The table is split by rows exactly as for ``vocab`` (same physical table,
slots and checkpoints). When the ranks of the group hold different ids (data
axes = table axes), vocab all-gathers every rank's ids and reduce-scatters
full rows, so each rank receives a row for every id of the group, ``G``
times the rows it needs. Here each rank receives about its own:

1. input distribution (``distribute``): bucket this rank's ids by owning
   rank into a static ``[group, capacity]`` buffer and ``all_to_all`` it
   (``send_ids``);
2. local lookup of the ids received (``[group * capacity, features]``);
3. output distribution: ``all_to_all`` the rows back, each into the slot
   its id left from, where the id reads it (a pooled request pools the rows
   it reads, with the bag's coefficients). Steps 2 and 3 are ``finish``.

Ranks holding the same ids (rest axes: tensor-parallel) each route a slice
of them and gather the rows after. The backward is the same route reversed:
autodiff transposes ``all_to_all`` into ``all_to_all`` and the local gather
into a scatter-add.

The capacity is static (JAX shapes are). A step with more ids for one owner
than the capacity is never dropped or corrupted: the whole group takes the
vocab path for that step (``lax.cond`` on the group's largest count), or,
with ``on_overflow="error"``, the count goes back to the caller to check.

Across nodes (``plan.node_route``), steps 1 and 3 each take two levels,
inside each node and then across, and a row crosses between two nodes once
however many of their ranks ask for it (``strategies.nodes``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from embedlib import sharding as sharding_lib
from embedlib import kernels
from embedlib.strategies import collectives, early, nodes, unique, vocab


def distribute(ids, *, plan, capacity: int):
  """Input distribution, step one: this rank's ids bucketed by the rank owning their rows.

  Needs the ids alone, never the table. A table whose ids are not its rows
  maps them first (a stack's logical rows: ``rowmap.physical_ids``) and
  hands the rows here. Ranks holding the same ids (rest axes) each bucket a
  slice of them (``collectives.rest_share``). The exchange of the buckets
  (``send_ids``) runs in ``finish`` in line, where an overflowing step
  never sends them, or ahead (``send_ahead``).

  Args:
    ids: an iterable of int32 arrays, this rank's rows of the physical
      table (``-1`` for invalid ids), read in order.
    plan: the table's ``EmbeddingPlan``.
    capacity: ids per destination (``sharded.route_capacity``).

  Returns:
    ``{"send": [group * capacity], "slot": [ids], "need": []}``: the send
    buffer and the slots of ``unique.bucketize``, and the group's largest
    bucket.
  """
  flat = jnp.concatenate([i.reshape(-1) for i in ids]).astype(jnp.int32)
  mine = collectives.rest_share(flat, plan.rest_axes)
  send, slot, need = unique.bucketize(mine, plan.padded_shape[0] // plan.group_size,
                                      plan.group_size, capacity)
  need = lax.pmax(need, plan.table_axes)
  return {"send": send, "slot": slot, "need": need}


def send_ahead(state, *, plan, table=None, gather=None):
  """``distribute``'s state with the buckets sent to their owners (``send_ids``): a step ahead.

  With ``table`` (early fetch), the rows too: each owner's rows as
  ``table`` holds them now (``"stale"``, kept at the owner) and sent back
  (``"rows"``); ``finish`` brings the rows changed since up to date
  (``rows_up_to_date``).

  Returns:
    ``{"received", "slot", "need"}`` (and ``"stale"``, ``"rows"``).
  """
  got = {"received": send_ids(state["send"], plan=plan), "slot": state["slot"],
         "need": state["need"]}
  if table is not None:
    got["stale"] = gather(table, asked(got["received"]))
    got["rows"] = rows_back(got["stale"], plan=plan, sent=got["received"])
  return got


def send_ids(send, *, plan):
  """Step 1's exchange: the ids each owner looks up, from every rank of its group.

  Depends on the ids alone, never on the table, so a step can run it ahead.

  Returns:
    int32 ``[group * capacity]``: the owner-local rows asked of this rank,
    ``-1`` in empty slots, in block order of the asking rank. Over several
    nodes (``plan.node_route``), a ``nodes.NodeSent`` holding them with what
    ``rows_back`` needs; ``asked`` reads the ids of either.
  """
  if plan.node_route:
    return nodes.send_ids(send, plan)
  return lax.all_to_all(send, plan.table_axes, 0, 0, tiled=True)


def asked(sent):
  """The owner-local rows ``send_ids`` asked of this rank (``-1`` for none), to look up."""
  return sent.ids if isinstance(sent, nodes.NodeSent) else sent


def rows_back(rows, *, plan, sent=None):
  """Step 3's exchange: each looked-up row back to the slot its id left from.

  ``rows``: ``[group * capacity, features]``, the rows of ``asked(sent)``;
  ``sent``: what ``send_ids`` returned, needed over several nodes.
  """
  if plan.node_route:
    if not isinstance(sent, nodes.NodeSent):
      raise ValueError(
          f"{plan.name}: the two-level route's rows_back needs what send_ids returned "
          f"(rows_back(rows, plan=plan, sent=sent)), got {type(sent).__name__}.")
    return nodes.rows_back(rows, sent, plan)
  return lax.all_to_all(rows, plan.table_axes, 0, 0, tiled=True)


def _rows_at_home(table, state, *, plan, gather, corrections):
  """Steps 1 (if not run ahead) to 3: ``[group * capacity, features]``, each slot's row."""
  if "rows" in state:  # fetched a step early
    return rows_up_to_date(table, state, corrections, plan=plan, gather=gather)
  sent = state["received"] if "received" in state else send_ids(state["send"], plan=plan)
  return rows_back(gather(table, asked(sent)), plan=plan, sent=sent)


def finish(table, requests, state, *, plan, gather, bag, capacity: int, fallback: bool,
           corrections: int | None = None):
  """The owners' lookup and the rows' way back, or the vocab path on overflow.

  Args:
    table: ``[rows_per_rank, features]``, this rank's rows.
    requests: ``Request`` s with this rank's ids (physical rows, ``-1``
      invalid), ``[tokens]``, ``[tokens, ...]`` or pooled ``[tokens, bag]``;
      the ids ``distribute`` bucketed.
    state: ``distribute``'s, or ``send_ahead``'s.
    plan: the table's ``EmbeddingPlan``.
    gather: local row kernel.
    bag: local pooled kernel.
    capacity: ids per destination.
    fallback: take the vocab path when a bucket of the group overflows
      (else the caller checks the returned count).
    corrections: for rows fetched early, the changed rows each owner can
      send each rank (``early.correction_capacity``).

  Returns:
    ``(outputs, need)``: per request, ``ids.shape + (features,)`` or
    ``[tokens, features]`` pooled; the group's largest bucket.
  """
  flat = jnp.concatenate([r.ids.reshape(-1) for r in requests]).astype(jnp.int32)

  def routed():
    back = _rows_at_home(table, state, plan=plan, gather=gather, corrections=corrections)
    if plan.rest_axes:
      rows = gather(back, state["slot"])
      rows = collectives.gather_rest(rows, plan.rest_axes, 0)[: flat.shape[0]]
      index = jnp.where(flat >= 0, jnp.arange(flat.shape[0], dtype=jnp.int32), -1)
    else:
      rows, index = back, state["slot"]
    outs, start = [], 0
    for r in requests:
      part = lax.slice_in_dim(index, start, start + r.ids.size).reshape(r.ids.shape)
      start += r.ids.size
      if r.pooled:
        coef = kernels.bag_coefficients(r.ids, r.weights, plan.padded_shape[0], r.combiner)
        outs.append(bag(rows, part, coef, combiner="sum"))
      else:
        outs.append(gather(rows, part))
    return tuple(_vary_like(o, flat) for o in outs)

  def unrouted():
    return tuple(
        _vary_like(vocab.finish(table, vocab.distribute(r.ids, r.weights, plan=plan,
                                                        combiner=r.combiner),
                                plan=plan, gather=gather, bag=bag), flat)
        for r in requests
    )

  need = state["need"]
  if not fallback:
    return routed(), need
  return lax.cond(need > capacity, unrouted, routed), need


def rows_up_to_date(table, got, corrections, *, plan, gather):
  """The early rows with every row the table has changed since replaced: ``rows_back`` exactly.

  Each owner reads its asked rows again and compares their bits with what
  it sent (``stale``); the changed ones (at most ``corrections`` per asking
  rank) go out with their slots and overwrite the early rows there. A step
  with more changed rows for one rank than that sends every row again.
  """
  fresh = gather(table, asked(got["received"]))
  if plan.node_route:
    # The corrections' exchange is the flat route's (a changed row goes
    # straight to the rank that asked); the two-level route's rows come back
    # deduplicated per node, so there every row is sent again: still exact.
    return rows_back(fresh, plan=plan, sent=got["received"])
  group = plan.group_size
  capacity = fresh.shape[0] // group
  changed = early.changed_rows(fresh, got["stale"]).reshape(group, capacity)
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
    return rows_back(fresh, plan=plan)

  return lax.cond(need > corrections, refetch, corrected)


def _vary_like(x, ids):
  """``x`` typed as varying over the axes the ids vary over: both branches agree."""
  missing = sharding_lib.varying_axes(ids) - sharding_lib.varying_axes(x)
  if not missing:
    return x
  return lax.pcast(x, tuple(sorted(missing)), to="varying")
