"""The sparse update for GPUs: sorted, reduced by a scan, written at distinct rows.

The XLA ops of ``apply.py`` sum each id's gradients with scatter-adds
whose indices collide (every occurrence of a hot id adds into its row).
XLA:GPU lowers such scatters to atomic adds, slow under contention and
summed in an order that changes from run to run. Here no scatter ever has
two updates for one row:

1. sort: the rank's local row of each id (``rows`` for ids it does not
   own), stable, carrying each id's position;
2. reduce: a segmented inclusive scan (``lax.associative_scan``) over the
   sorted rows' gradients; the last element of each run of equal rows holds
   the run's sum. The scan's tree is fixed by the number of ids, so the sums
   are the same on every run (a run of one or two ids is summed as the
   other paths sum it; longer runs in the tree's order);
3. apply: the rule runs at every sorted position, each run's last one
   carrying its row; the others point past the shard (each at its own
   index) and are dropped;
4. write: table and slots are updated at those positions, each owned row
   exactly once (``unique_indices``: no atomics).

Inside `fused_gpu.use` (True), steps 2 to 4 are one Mosaic GPU kernel where
it takes the rule and table (``fused_gpu.py``); it was measured slower than
these XLA ops on an H200, so it is not the default.

`apply._local_update` runs this on every platform but CPU (inside
``lax.platform_dependent``); `use` makes the CPU run it too, or the other
platforms run the XLA ops instead, for tests and benchmarks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from embedlib import options
from embedlib.optim import fused_gpu, trace_switch

_switch = trace_switch.TraceSwitch()


def use(enabled: bool):
  """Within the block, traces run this update on every platform (True) or none (False).

  False gives every platform but CPU ``apply.py``'s XLA ops, the update
  GPUs ran before this one (for comparisons); the CPU keeps its own update
  either way unless True. The choice is made when a step is traced, so
  jax's caches are cleared on entry and exit. Nests.
  """
  return _switch.use(enabled)


def forced() -> bool | None:
  """The choice of the innermost `use` block, or None outside any."""
  return _switch.forced()


def segmented_sums(keys, values):
  """Inclusive sums of ``values`` over runs of equal ``keys`` (``keys`` sorted).

  Args:
    keys: ``[n]`` sorted.
    values: ``[n, f]``.

  Returns:
    ``(sums, last)``: ``sums[i]`` is the sum of ``values`` from the start of
    ``i``'s run to ``i``; ``last[i]`` whether ``i`` ends its run.

  >>> sums, last = segmented_sums(jnp.array([1, 1, 4, 6, 6, 6]),
  ...                             jnp.array([[1.0], [2.0], [4.0], [1.0], [1.0], [1.0]]))
  >>> sums[:, 0].tolist(), last.tolist()
  ([1.0, 3.0, 4.0, 1.0, 2.0, 3.0], [False, True, True, False, False, True])
  """
  n = keys.shape[0]
  edge = jnp.ones((min(n, 1),), bool)  # no run starts or ends in zero keys
  first = jnp.concatenate([edge, keys[1:] != keys[:-1]])
  last = jnp.concatenate([keys[1:] != keys[:-1], edge])

  def combine(a, b):
    a_start, a_sum = a
    b_start, b_sum = b
    return a_start | b_start, jnp.where(b_start[..., None], b_sum, a_sum + b_sum)

  _, sums = lax.associative_scan(combine, (first, values))
  return sums, last


def local_update(rule, table, slots, ids, grads, lr, step, *, plan, origin):
  """One rank's update of its shard by sorting: same contract as ``apply._local_update``.

  Args:
    rule: a ``RowRule``.
    table: this rank's shard, ``plan.shard_shape``.
    slots: slot name -> this rank's slot shard.
    ids: ``[n]`` int32 global ids, ``-1`` invalid.
    grads: ``[n, features]`` float, their row gradients (all logical columns).
    lr, step: scalars.
    plan: the table's ``EmbeddingPlan``.
    origin: ``(first_row, first_col)`` of this shard (``apply._shard_origin``).

  Returns:
    ``(table, slots)`` with each touched owned row updated once.
  """
  rows_here, cols_here = table.shape
  first_row, first_col = origin
  local = ids - first_row
  owned = (ids >= 0) & (local >= 0) & (local < rows_here)
  key = jnp.where(owned, local, rows_here).astype(jnp.int32)
  position = jnp.arange(ids.shape[0], dtype=jnp.int32)
  key, position = lax.sort((key, position), num_keys=1, is_stable=True)
  xla_ops = lambda: _by_scan(rule, table, slots, key, position, grads, lr, step, plan=plan,
                             first_col=first_col)
  if key.shape[0] and fused_gpu.supports(rule, table, plan, slots):
    return fused_gpu.update(rule, table, slots, key, position, grads, lr, step, plan=plan,
                            first_col=first_col, xla_ops=xla_ops)
  return xla_ops()


def _by_scan(rule, table, slots, key, position, grads, lr, step, *, plan, first_col):
  """Steps 2 to 4 of the module docstring, from ``local_update``'s sorted keys on."""
  rows_here, cols_here = table.shape
  sums, last = segmented_sums(key, grads.astype(jnp.float32)[position])
  # One position per touched owned row; every other one points past the
  # shard, each at its own index, so that all indices are distinct.
  idx = jnp.where(last & (key < rows_here), key, rows_here + jnp.arange(key.shape[0]))
  old = {k: v.at[idx].get(mode="fill", fill_value=0) for k, v in slots.items()}
  # Over the logical columns, before any column slicing: row-wise rules
  # normalise by the whole row on every rank.
  row_sq_mean = jnp.sum(sums * sums, axis=1) / plan.features
  g = sums
  if plan.strategy in options.COLUMN_SPLIT:
    g = jnp.pad(g, ((0, 0), (0, plan.padded_shape[1] - plan.features)))
    g = lax.dynamic_slice_in_dim(g, first_col, cols_here, axis=1)
  delta, new_slots = rule.update(old, g, row_sq_mean=row_sq_mean, lr=lr, step=step)
  table = table.at[idx].add(delta.astype(table.dtype), mode="drop", unique_indices=True)
  out = {}
  for name, value in slots.items():
    new = new_slots.get(name, old[name])
    out[name] = value.at[idx].set(new.astype(value.dtype), mode="drop", unique_indices=True)
  return table, out
