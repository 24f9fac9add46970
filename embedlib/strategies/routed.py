"""Owner-routed row sharding: each id goes to the rank owning its row, the row comes back.

The table is split by rows exactly as for ``vocab`` (same physical table,
slots and checkpoints). When the ranks of the group hold different ids (data
axes = table axes), vocab all-gathers every rank's ids and reduce-scatters
full rows, so each rank receives a row for every id of the group, ``G``
times the rows it needs. Here each rank receives about its own:

1. input distribution: bucket this rank's ids by owning rank into a static
   ``[group, capacity]`` buffer and ``all_to_all`` it;
2. local lookup of the ids received (``[group * capacity, features]``);
3. output distribution: ``all_to_all`` the rows back, each into the slot
   its id left from, where the id reads it (a pooled request pools the rows
   it reads, with the bag's coefficients).

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

import jax
import jax.numpy as jnp
from jax import lax

from embedlib import sharding as sharding_lib
from embedlib.kernels import reference
from embedlib.strategies import collectives, nodes, vocab


def bucketize(ids, rows_per_rank: int, group: int, capacity: int):
  """Input distribution, step one: each id's slot in a per-owner send buffer.

  The owners' buckets are found with one stable sort of the owners (the
  ids' positions ride along); an id's place in its bucket is its place in
  the sorted run of its owner, so no two ids of one owner share a slot and
  the earlier ids of a bucket keep the slots when it overflows.

  Args:
    ids: int32 ``[n]`` rows of the (physical) table, ``-1`` for none.
    rows_per_rank: rows each rank owns (row ``r`` lives on ``r // rows_per_rank``).
    group: ranks in the table group.
    capacity: ids per destination.

  Returns:
    ``(send, slot, need)``: ``send`` int32 ``[group * capacity]``, the
    owner-local row of each id in its owner's block (``-1`` in empty
    slots); ``slot`` int32 ``[n]``, where each id's row comes back (``-1``
    for invalid ids and for ids past the capacity); ``need`` int32, the
    largest bucket (the capacity this step needs).

  >>> send, slot, need = bucketize(jnp.array([5, 0, -1, 4, 7]), 4, 2, 2)
  >>> send.tolist(), slot.tolist(), int(need)
  ([0, -1, 1, 0], [2, 0, -1, 3, -1], 3)
  """
  n = ids.shape[0]
  owner = jnp.where(ids >= 0, ids // rows_per_rank, group).astype(jnp.int32)
  iota = jnp.arange(n, dtype=jnp.int32)
  sorted_owner, perm = lax.sort((owner, iota), num_keys=1, is_stable=True)
  starts = jnp.searchsorted(
      sorted_owner, jnp.arange(group + 1, dtype=jnp.int32), method="scan_unrolled"
  ).astype(jnp.int32)
  place = jnp.zeros((n,), jnp.int32).at[perm].set(iota - starts[sorted_owner],
                                                   unique_indices=True)
  need = jnp.max(starts[1:] - starts[:-1])
  kept = (owner < group) & (place < capacity)
  slot = jnp.where(kept, owner * capacity + place, -1)
  local = ids - owner * rows_per_rank
  send = jnp.full((group * capacity,), -1, jnp.int32)
  # Distinct indices, dropped ones each past the end: no atomics on a GPU.
  send = send.at[jnp.where(kept, slot, group * capacity + iota)].set(
      local, mode="drop", unique_indices=True)
  return send, slot, need


def exchange(table, send, *, plan, gather):
  """Ids out to their owners, local lookup, rows back (steps 1 to 3).

  Args:
    table: ``[rows_per_rank, features]``, this rank's rows.
    send: int32 ``[group * capacity]`` from ``bucketize``.
    plan: the table's ``EmbeddingPlan``.
    gather: local kernel; ``-1`` reads a zero row.

  Returns:
    ``[group * capacity, features]``: in each slot, the row of the id that
    left from it.
  """
  sent = send_ids(send, plan=plan)
  return rows_back(gather(table, asked(sent)), plan=plan, sent=sent)


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


def _my_slice(flat, rest_axes):
  """This rank's share of ids that every rank along ``rest_axes`` holds."""
  if not rest_axes:
    return flat
  ranks = lax.psum(1, rest_axes)
  flat = sharding_lib.pad_tokens(flat, ranks, -1)
  size = flat.shape[0] // ranks
  return lax.dynamic_slice_in_dim(flat, lax.axis_index(rest_axes) * size, size)


def lookup_requests(table, requests, *, plan, gather, bag, capacity: int, fallback: bool):
  """Routed lookup of several requests of one table, in one route.

  Args:
    table: ``[rows_per_rank, features]``, this rank's rows.
    requests: ``Request`` s with this rank's ids (physical rows, ``-1``
      invalid), ``[tokens]``, ``[tokens, ...]`` or pooled ``[tokens, bag]``.
    plan: the table's ``EmbeddingPlan``.
    gather: local row kernel.
    bag: local pooled kernel.
    capacity: ids per destination.
    fallback: take the vocab path when a bucket of the group overflows
      (else the caller checks the returned count).

  Returns:
    ``(outputs, need)``: per request, ``ids.shape + (features,)`` or
    ``[tokens, features]`` pooled; the group's largest bucket.
  """
  flat = jnp.concatenate([r.ids.reshape(-1) for r in requests]).astype(jnp.int32)
  mine = _my_slice(flat, plan.rest_axes)
  send, slot, need = bucketize(mine, table.shape[0], plan.group_size, capacity)
  need = lax.pmax(need, plan.table_axes)
  return outputs(table, requests, slot, need, lambda: exchange(table, send, plan=plan,
                                                               gather=gather),
                 plan=plan, gather=gather, bag=bag, capacity=capacity, fallback=fallback)


def outputs(table, requests, slot, need, rows_back_here, *, plan, gather, bag,
            capacity: int, fallback: bool):
  """The requests' outputs from the rows routed back, or the vocab path on overflow.

  What follows the route's exchanges, shared by the in-line lookup and one
  whose ids went out a step ahead (``strategies.ahead``).

  Args:
    table: ``[rows_per_rank, features]``, this rank's rows.
    requests: as ``lookup_requests`` takes them.
    slot: ``bucketize`` 's slots of this rank's ids.
    need: the group's largest bucket.
    rows_back_here: ``() -> [group * capacity, features]``, the rows back
      in this rank's slots (called only when the route is taken).
    plan, gather, bag, capacity, fallback: as ``lookup_requests`` takes them.

  Returns:
    ``(outputs, need)`` as ``lookup_requests`` returns them.
  """
  flat = jnp.concatenate([r.ids.reshape(-1) for r in requests]).astype(jnp.int32)

  def routed():
    back = rows_back_here()
    if plan.rest_axes:
      rows = gather(back, slot)
      rows = collectives._gather_rest(rows, plan.rest_axes, 0)[: flat.shape[0]]
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
    return tuple(_vary_like(o, flat) for o in outs)

  def unrouted():
    return tuple(
        _vary_like(
            vocab.bag_lookup(table, r.ids, r.weights, plan=plan, bag=bag, combiner=r.combiner)
            if r.pooled else vocab.lookup(table, r.ids, plan=plan, gather=gather),
            flat,
        )
        for r in requests
    )

  if not fallback:
    return routed(), need
  return lax.cond(need > capacity, unrouted, routed), need


def _vary_like(x, ids):
  """``x`` typed as varying over the axes the ids vary over: both branches agree."""
  missing = sharding_lib.varying_axes(ids) - sharding_lib.varying_axes(x)
  if not missing:
    return x
  return lax.pcast(x, tuple(sorted(missing)), to="varying")
