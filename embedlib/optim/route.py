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
several ranks). A step with more distinct ids for one owner than the
capacity takes the all-gather instead, inside a ``lax.cond`` on the
largest bucket anywhere, so no gradient is dropped.

The ``lax.cond`` picks only what arrives, never the update: a cond whose
branches update the table makes XLA copy the table and its slots (each
branch needs an output buffer of its own, so the donated table can't be
written in place). Both branches return one static size, the larger of the
two routes, padded with ``-1`` ids, and one update follows the cond. The
update then has the all-gather's ``[ids, features]`` temporaries; the
route saves bytes moved, not the update's scratch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from embedlib import options
from embedlib import sharding as sharding_lib
from embedlib.optim import sorted_update
from embedlib.plan import cost, mesh_axes
from embedlib.strategies import collectives, routed


def outer_axes(plan) -> tuple[str, ...]:
  """Data axes outside the table group: replicas of each shard."""
  return tuple(a for a in plan.data_axes if a not in plan.table_axes)


def pays(plan, ids_per_device: int, features: int, itemsize: int) -> bool:
  """Whether routing moves fewer bytes than all-gathering, for this table and step.

  Static (shapes only). Routing needs a row-split table whose group holds
  different ids; it then moves about ``capacity * group`` entries per rank,
  the all-gather ``ids * data shards``.
  """
  if plan.strategy not in options.ROW_SHARDED or not plan.token_axes or plan.group_size < 2:
    return False
  shape = dict(plan.mesh_shape)
  entry = cost.ID_BYTES + features * itemsize
  outer = mesh_axes.axes_size(shape, outer_axes(plan))
  capacity = plan.capacity_for(ids_per_device)
  routed_bytes = (plan.group_size - 1) * capacity * entry
  routed_bytes += (outer - 1) * plan.group_size * capacity * entry
  gathered = (plan.data_shards - 1) * ids_per_device * entry
  return routed_bytes < gathered


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


def _bucket(ids, grads, *, plan, rows_per_rank: int, capacity: int):
  """Steps 1 and 2 up to the send buffers, and the largest bucket anywhere."""
  unique, sums = sum_duplicates(ids, grads)
  if plan.rest_axes:  # ranks sharing these ids each send a slice
    ranks = lax.psum(1, plan.rest_axes)
    size = -(-unique.shape[0] // ranks)
    unique = jnp.pad(unique, (0, size * ranks - unique.shape[0]), constant_values=-1)
    sums = jnp.pad(sums, ((0, size * ranks - sums.shape[0]), (0, 0)))
    start = lax.axis_index(plan.rest_axes) * size
    unique = lax.dynamic_slice_in_dim(unique, start, size)
    sums = lax.dynamic_slice_in_dim(sums, start, size)
  group = plan.group_size
  send, slot, need = routed.bucketize(unique, rows_per_rank, group, capacity)
  slots = group * capacity
  send_grads = jnp.zeros((slots, sums.shape[1]), sums.dtype)
  dropped = slots + jnp.arange(slot.shape[0], dtype=jnp.int32)  # distinct: no atomics on GPU
  send_grads = send_grads.at[jnp.where(slot >= 0, slot, dropped)].set(
      sums, mode="drop", unique_indices=True)
  return send, send_grads, lax.pmax(need, plan.table_axes + outer_axes(plan))


def _exchange(send, send_grads, *, plan, rows_per_rank: int):
  """Step 2's all-to-alls and step 3's gather: what this rank updates."""
  axes = plan.table_axes
  received = lax.all_to_all(send, axes, 0, 0, tiled=True)
  received_grads = lax.all_to_all(send_grads, axes, 0, 0, tiled=True)
  offset = collectives.group_rank(axes) * rows_per_rank
  received = jnp.where(received >= 0, received + offset, -1)
  outer = outer_axes(plan)
  if outer:
    gather = lambda x: lax.all_gather(x, outer, axis=0, tiled=True, to="invarying")
    received, received_grads = gather(received), gather(received_grads)
  return received, received_grads


def _pad(ids, grads, size: int):
  """``ids`` and ``grads`` padded to ``size`` entries: ``-1`` ids, zero gradients."""
  extra = size - ids.shape[0]
  return (jnp.pad(ids, (0, extra), constant_values=-1),
          jnp.pad(grads, ((0, extra), (0, 0))))


def routed_or_gathered(ids, grads, *, plan, rows_per_rank: int, capacity: int, gathered):
  """What this rank updates: the routed input distribution, or on overflow ``gathered()``.

  Inside ``shard_map``.

  Args:
    ids: ``[n]`` int32 global rows, ``-1`` invalid: this rank's ids.
    grads: ``[n, features]``, their row gradients.
    plan: the table's ``EmbeddingPlan``.
    rows_per_rank: rows each rank owns.
    capacity: distinct ids per destination.
    gathered: ``gathered() -> (ids, grads)``, the all-gather path, for a
      step that overflows the capacity.

  Returns:
    ``(ids [m], grads [m, features])``, ``-1`` padded to the larger of the
    two paths' sizes, whichever path the step took.
  """
  send, send_grads, need = _bucket(ids, grads, plan=plan, rows_per_rank=rows_per_rank,
                                   capacity=capacity)
  routed_fn = lambda: _exchange(send, send_grads, plan=plan, rows_per_rank=rows_per_rank)
  shapes = [jax.eval_shape(f) for f in (routed_fn, gathered)]
  size = max(i.shape[0] for i, _ in shapes)
  # The gathered pairs are the same on every rank, the routed ones not: both
  # typed as varying over every axis either varies over, as cond requires.
  vary = frozenset().union(*(sharding_lib.varying_axes(x) for pair in shapes for x in pair))

  def padded(fn):
    cast = lambda x: _vary(x, vary)
    return lambda: tuple(map(cast, _pad(*fn(), size)))

  return lax.cond(need > capacity, padded(gathered), padded(routed_fn))


def _vary(x, axes):
  missing = tuple(sorted(frozenset(axes) - sharding_lib.varying_axes(x)))
  return lax.pcast(x, missing, to="varying") if missing else x
