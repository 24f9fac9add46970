"""The dynamic map over a mesh: each device runs the policy on the buckets it owns.

Buckets are contiguous row blocks and the rows are split over the table
axes in contiguous blocks, so device ``d`` of the table group owns buckets
``[d * B / G, (d + 1) * B / G)`` and their rows, keys, scores and sketch:
no device holds the whole map. The step's ids come to every device of the
group replicated (``in_specs=P()``: where the caller's ids are split over
data axes, XLA all-gathers them, 8 bytes per id), each owner runs
``step.train_step`` on its buckets' ids, and one ``psum`` of an int32 per
id over the table axes hands every device every id's row (an owner adds
``row + 1``, the others 0). Per step a device moves ``8 * ids`` bytes in
and ``4 * ids`` out, whatever the table's size; routing each id to its owner
with the routed layout's all-to-all would cut that by the group size.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from embedlib.dynamic import ids as ids_lib
from embedlib.dynamic import policy as policy_lib
from embedlib.dynamic import step as step_lib


def _own(flat, policy, index, group):
  hi, lo = flat[:, 0], flat[:, 1]
  pad = (hi == jnp.uint32(ids_lib.PAD_WORD)) & (lo == jnp.uint32(ids_lib.PAD_WORD))
  bucket = ids_lib.bucket_of(hi, lo, policy.num_buckets)
  per = policy.num_buckets // group
  own = ~pad & (bucket // per == index)
  return hi, lo, own, bucket - index * per, per * policy.bucket_size


def _local(state, clock, flat, *, policy, train, index, group):
  hi, lo, own, bucket, rows_per = _own(flat, policy, index, group)
  if train:
    state, rows, placed, stats = step_lib.train_step(
        state, hi, lo, own, bucket, clock, policy=policy)
  else:
    rows = step_lib.lookup(state, hi, lo, own, bucket, bucket_size=policy.bucket_size)
    placed = jnp.zeros(rows.shape, bool)
    stats = jnp.stack([jnp.sum(state.score >= 0), jnp.int32(0), jnp.int32(0),
                       jnp.sum(own & (rows < 0))]).astype(jnp.int32)
  rows = jnp.where(rows >= 0, rows + index * rows_per, -1)
  return state, rows, placed, jnp.concatenate([stats, jnp.sum(own, keepdims=True).astype(jnp.int32)])


@functools.partial(jax.jit, static_argnames=("policy", "mesh", "table_axes", "train"))
def run(state: step_lib.MapState, clock, flat, *, policy: policy_lib.Policy, mesh,
        table_axes: tuple, train: bool):
  """The map's step (or look-up) for ``flat`` uint32 ``[m, 2]`` id words.

  Returns:
    ``(state, rows, placed, stats)``: rows int32 ``[m]`` (global row,
    ``-1``: the default), placed bool ``[m]``, stats int32 ``[5]`` (resident
    rows, admitted, evicted, lookups reading the default, lookups).
  """
  group = 1
  if mesh is not None and table_axes:
    group = math.prod(dict(mesh.shape)[a] for a in table_axes)
  if group == 1:
    return _local(state, clock, flat, policy=policy, train=train, index=0, group=1)
  split = P(table_axes)
  has_sketch = state.sketch is not None

  def body(khi, klo, score, sketch, clock, flat):
    index = lax.axis_index(table_axes)
    local = step_lib.MapState(khi, klo, score, sketch if has_sketch else None)
    local, rows, placed, stats = _local(local, clock, flat, policy=policy, train=train,
                                        index=index, group=group)
    rows = lax.psum(rows + 1, table_axes) - 1
    placed = lax.psum(placed.astype(jnp.int32), table_axes) > 0
    stats = lax.psum(stats, table_axes)
    sketch = local.sketch if has_sketch else jnp.zeros((group,), jnp.uint8)
    return local.keys_hi, local.keys_lo, local.score, sketch, rows, placed, stats

  sketch = state.sketch if has_sketch else jnp.zeros((group,), jnp.uint8)
  out = jax.shard_map(
      body, mesh=mesh,
      in_specs=(split, split, split, split, P(), P()),
      out_specs=(split, split, split, split, P(), P(), P()),
      check_vma=False,
  )(state.keys_hi, state.keys_lo, state.score, sketch, clock, flat)
  khi, klo, score, sketch, rows, placed, stats = out
  return (step_lib.MapState(khi, klo, score, sketch if has_sketch else None),
          rows, placed, stats)
