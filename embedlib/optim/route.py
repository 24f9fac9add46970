"""Row gradients to the ranks owning their rows: the sparse update's routed input distribution.

Without it every rank all-gathers every rank's ``(ids, row gradients)``
over the data axes, receiving the whole global batch's gradients to update
the few rows it owns. For a row-split table whose group holds different ids
(token axes), each rank instead:

1. sums its gradients per distinct id (duplicates never travel twice);
2. buckets the distinct ids by owning rank into a static
   ``[group, capacity]`` buffer, the summed gradients beside them, and
   ``all_to_all`` s both over the table group (ranks holding the same ids,
   the rest axes, each send a slice of them);
3. all-gathers what it received over the data axes outside the group
   (replicas of its shard, whose updates must agree).

The owner then dedups and updates as before (it may receive one id from
several ranks). Over several nodes (``plan.node_update``) step 2 takes two
levels, as the routed lookup does (``strategies.routed``): the pairs go
to their local index inside the node, each id's gradients from the node's
ranks are summed there, and one pair per id crosses to the owner's node
(the flat buffers instead for a step with more distinct ids for one owner
than the node capacity). The sums are added in another order than the
flat route's: equal to the last bits, not bit for bit.

Every buffer is ``[group * capacity]`` entries per round, the update's
scratch included, whatever the batch. A step with more
distinct ids for one owner than the capacity takes more rounds
(``routed_update``), never the all-gather: no gradient is dropped and no
buffer grows. The rounds are a ``while_loop`` carrying the table and slots,
updated in place (a ``lax.cond`` whose branches update the table makes XLA
copy the table and its slots: each branch needs an output buffer of its own).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from embedlib.optim import sorted_update
from embedlib.strategies import collectives, nodes
from embedlib.strategies import unique as unique_lib


def pays(plan, ids_per_device: int, itemsize: int) -> bool:
  """Whether routing moves fewer bytes than all-gathering, for this table and step.

  Static (shapes only): ``plan.sparse_update`` 's choice. Routing needs a
  row-split table whose group holds different ids; it then moves about
  ``capacity * group`` entries per rank, the all-gather ``ids * data shards``.
  """
  return plan.sparse_update(ids_per_device, itemsize)[0] == "route"


def sum_duplicates(ids, grads):
  """One summed gradient per distinct id, in ``ids``'s static size.

  Returns:
    ``(unique [n] int32, -1 padded; sums [n, features] in grads.dtype)``.

  >>> u, s = sum_duplicates(jnp.array([4, -1, 4, 2]), jnp.ones((4, 1)))
  >>> u.tolist(), s[:, 0].tolist()
  ([2, 4, -1, -1], [1.0, 2.0, 0.0, 0.0])
  """
  n = ids.shape[0]
  # Sorted runs summed by a scan, each written once: a segment_sum would
  # scatter-add with colliding indices, which XLA:GPU runs as atomics.
  none = jnp.iinfo(jnp.int32).max
  iota = jnp.arange(n, dtype=jnp.int32)
  key, position = lax.sort((jnp.where(ids >= 0, ids, none).astype(jnp.int32), iota),
                           num_keys=1, is_stable=True)
  sums, last = sorted_update.segmented_sums(key, grads.astype(jnp.float32)[position])
  keep = last & (key != none)
  slot = jnp.where(keep, jnp.cumsum(keep) - 1, n + iota)  # distinct, past the end if dropped
  unique = jnp.full((n,), -1, jnp.int32).at[slot].set(key, mode="drop", unique_indices=True)
  out = jnp.zeros((n, grads.shape[1]), jnp.float32).at[slot].set(
      sums, mode="drop", unique_indices=True)
  return unique, out.astype(grads.dtype)


def _my_slice(unique, sums, plan):
  """Ranks sharing these ids (the rest axes) each send a slice of them (still sorted)."""
  if not plan.rest_axes:
    return unique, sums
  ranks = lax.psum(1, plan.rest_axes)
  size = -(-unique.shape[0] // ranks)
  unique = jnp.pad(unique, (0, size * ranks - unique.shape[0]), constant_values=-1)
  sums = jnp.pad(sums, ((0, size * ranks - sums.shape[0]), (0, 0)))
  start = lax.axis_index(plan.rest_axes) * size
  return (lax.dynamic_slice_in_dim(unique, start, size),
          lax.dynamic_slice_in_dim(sums, start, size))


_NO_ID = jnp.iinfo(jnp.int32).max


def _round_bounds(keys, starts, low, capacity: int, axes):
  """Per owner, the ids below which every rank's next round fits the capacity.

  ``keys`` are this rank's distinct ids, sorted (``_NO_ID`` for none), and
  owner ``d`` 's run of them is ``keys[starts[d]:starts[d + 1]]``. A rank
  with more than ``capacity`` ids at or above ``low[d]`` for owner ``d``
  proposes the ``capacity + 1`` th of them as the bound; the round takes
  the smallest proposal over every rank (``pmin``), so no rank sends an
  owner more than ``capacity`` ids and each row's gradients all travel in
  the same round.
  """
  first = jnp.maximum(starts[:-1], jnp.searchsorted(keys, low, method="scan_unrolled"))
  left = starts[1:] - first
  at = jnp.minimum(first + capacity, keys.shape[0] - 1)
  proposal = jnp.where(left > capacity, keys[at], _NO_ID).astype(jnp.int32)
  return lax.pmin(proposal, axes)


def _send(unique, sums, low, high, *, rows_per_rank: int, group: int, capacity: int):
  """This round's send buffers: the ids in ``[low, high)`` of their owner, and their sums."""
  owner = jnp.where(unique >= 0, unique // rows_per_rank, 0)
  now = (unique >= 0) & (unique >= low[owner]) & (unique < high[owner])
  send, slot, _ = unique_lib.bucketize(jnp.where(now, unique, -1), rows_per_rank, group, capacity)
  slots = group * capacity
  dropped = slots + jnp.arange(slot.shape[0], dtype=jnp.int32)  # distinct: no atomics on GPU
  send_grads = jnp.zeros((slots, sums.shape[1]), sums.dtype).at[
      jnp.where(slot >= 0, slot, dropped)].set(sums, mode="drop", unique_indices=True)
  return send, send_grads


def _exchange(send, send_grads, *, plan, rows_per_rank: int):
  """Step 2's all-to-alls and step 3's gather: what this rank updates."""
  axes = plan.table_axes
  if plan.node_update:
    received, received_grads = _node_exchange(send, send_grads, plan)
  else:
    received = lax.all_to_all(send, axes, 0, 0, tiled=True)
    received_grads = lax.all_to_all(send_grads, axes, 0, 0, tiled=True)
  offset = collectives.group_rank(axes) * rows_per_rank
  received = jnp.where(received >= 0, received + offset, -1)
  outer = plan.outer_axes
  if outer:
    gather = lambda x: lax.all_gather(x, outer, axis=0, tiled=True, to="invarying")
    received, received_grads = gather(received), gather(received_grads)
  return received, received_grads


def routed_update(ids, grads, table, slots, *, plan, rows_per_rank: int, capacity: int, update):
  """Routes this rank's summed row gradients to their owners and updates, in rounds.

  Inside ``shard_map``. A round sends each owner at most ``capacity`` ids
  from each rank, so every buffer (sent, received, and the update's) is
  ``[group * capacity]`` entries, whatever the batch. A step whose ids fit
  takes one round; one that would overflow takes more, split by id ranges
  agreed over the group (``_round_bounds``) so that a row's gradients from
  every rank arrive in the same round and it is updated once, as by the
  all-gather. The rounds are a ``while_loop`` carrying the table and slots,
  which XLA updates in place (a ``lax.cond`` with the update in its
  branches would copy them).

  Args:
    ids: ``[n]`` int32 global rows, ``-1`` invalid: this rank's ids.
    grads: ``[n, features]``, their row gradients.
    table: this rank's table shard.
    slots: this rank's slot shards.
    plan: the table's ``EmbeddingPlan``.
    rows_per_rank: rows each rank owns.
    capacity: distinct ids per destination and round.
    update: ``update(table, slots, ids, grads) -> (table, slots)``, the
      local update of what arrived.

  Returns:
    ``(table, slots)`` updated.
  """
  unique, sums = _my_slice(*sum_duplicates(ids, grads), plan)
  group = plan.group_size
  axes = plan.table_axes + plan.outer_axes
  keys = jnp.where(unique >= 0, unique, _NO_ID)  # sorted: -1s are at the end
  owner = jnp.where(unique >= 0, unique // rows_per_rank, group).astype(jnp.int32)
  starts = jnp.searchsorted(owner, jnp.arange(group + 1, dtype=jnp.int32),
                            method="scan_unrolled").astype(jnp.int32)

  def one_round(carry):
    table, slots, low, _ = carry
    high = _round_bounds(keys, starts, low, capacity, axes)
    send, send_grads = _send(unique, sums, low, high, rows_per_rank=rows_per_rank,
                             group=group, capacity=capacity)
    table, slots = update(table, slots, *_exchange(send, send_grads, plan=plan,
                                                   rows_per_rank=rows_per_rank))
    # Another round while some rank holds ids at or above some owner's bound.
    more = lax.pmax(jnp.any(high < _NO_ID).astype(jnp.int32), axes)
    return table, slots, high, more > 0

  carry = (table, slots, jnp.zeros((group,), jnp.int32), jnp.bool_(True))
  table, slots, _, _ = lax.while_loop(lambda c: c[3], one_round, carry)
  return table, slots



def _node_exchange(send, send_grads, plan):
  """Step 2 over nodes: pairs inside the node, summed per id, one pair per id across.

  Returns the ids (owner-local rows, ``-1`` for none) and gradients this
  rank receives, ``[group * capacity]`` entries as the flat route's.
  """
  n_nodes, per = plan.nodes, plan.devices_per_node
  capacity = send.shape[0] // plan.group_size
  cap = plan.node_capacity_for(capacity)
  features = send_grads.shape[-1]

  def inside(x):  # [destination node, node rank, slot, ...] per destination node
    x = x.reshape(n_nodes, per, capacity, *x.shape[1:]).swapaxes(0, 1)
    x = nodes.within_node(x, plan).swapaxes(0, 1)
    return x.reshape(n_nodes, per * capacity, *x.shape[3:])

  ids, grads = inside(send), inside(send_grads)
  unique, sums = jax.vmap(sum_duplicates)(ids, grads)
  crowded = lax.pmax(jnp.max(jnp.sum(unique >= 0, axis=1)), plan.table_axes) > cap

  def distinct():
    pad = per * capacity - cap
    return (jnp.pad(nodes.across_nodes(unique[:, :cap], plan), ((0, 0), (0, pad)),
                    constant_values=-1),
            jnp.pad(nodes.across_nodes(sums[:, :cap], plan), ((0, 0), (0, pad), (0, 0))))

  received, received_grads = lax.cond(
      crowded, lambda: (nodes.across_nodes(ids, plan), nodes.across_nodes(grads, plan)), distinct)
  return received.reshape(-1), received_grads.reshape(-1, features)
