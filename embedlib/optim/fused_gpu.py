"""The fused GPU update: after the sort, one Mosaic GPU kernel reduces each run and applies the rule.

``sorted_update.local_update`` sorts the ids; for the rules and tables the
kernel takes (`supports`) the runs of equal rows go to
``kernels/mosaic_update.py``, which sums each run's gradients in order and
updates its table row (and Adam's moments) in place, instead of the scan,
the rule over every sorted position and the writes of the XLA ops. Every
strategy runs it: a row-sharded or replicated rank updates its rows, a
hidden-sharded one its column slice of every touched row, a grid one its
column slice of its touched rows (the slice of the
gradients goes in, and for AdaGrad the whole rows too, for the row's sum of
squares). Elsewhere (other rules or dtypes, rows that are not whole 16-byte
units, rows too wide for shared memory, jax 0.10) the XLA ops run.

Not by default: on an H200 the kernel took longer than the sorted XLA ops
it replaces for every rule (``benchmarks/README.md``, "GPU sparse update
and steps"), so a step runs it only inside `use` (True), which compiles it
into the CUDA branch of the step and makes the CPU interpret it, for tests
and benchmarks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from embedlib import options
from embedlib.kernels import mosaic_update, platforms
from embedlib.optim import rules as rules_lib
from embedlib.optim import trace_switch

_switch = trace_switch.TraceSwitch()

#: The rules the kernel implements (exact types: a subclass may change the math).
_RULES = {rules_lib.SparseSGD: mosaic_update.SGD, rules_lib.RowWiseAdagrad: mosaic_update.ADAGRAD,
          rules_lib.LazyAdam: mosaic_update.ADAM}


def use(enabled: bool):
  """Within the block, traces run the fused kernel on every platform (True) or none (False).

  True compiles the kernel for CUDA and makes the CPU interpret it (Mosaic
  GPU's interpreter, jax >= 0.11) where ``sorted_update`` runs; False, like
  no block, gives ``sorted_update``'s XLA ops. The choice is made when a
  step is traced, so jax's caches are cleared on entry and exit. Nests.
  """
  return _switch.use(enabled)


def supports(rule, table, plan, slots=None) -> bool:
  """Whether the kernel updates this shard with this rule (only inside `use` (True)).

  ``slots``: this shard's slots, by name; the kernel takes float32 table slots.
  """
  if _switch.forced() is not True:
    return False
  if type(rule) not in _RULES:
    return False
  name = _RULES[type(rule)]
  sliced = plan.strategy in options.COLUMN_SPLIT   # a slice of each row's columns
  if not sliced and table.shape[1] != plan.features:
    return False
  table_slots = mosaic_update.TABLE_SLOTS[name]
  if slots is not None and any(slots[k].dtype != jnp.float32 for k in table_slots):
    return False
  # A column slice's AdaGrad also sums the whole rows, for their squares.
  sq_width = plan.features if sliced and name == mosaic_update.ADAGRAD else 0
  return mosaic_update.supports(table.shape, table.dtype, rule=name, sq_width=sq_width)


def _runs(key, rows_here):
  """``(starts, ends, rows)`` ``[n]`` of the runs of equal owned rows in the sorted ``key``.

  Runs past the last are empty and point past the shard, each at its own row.
  """
  n = key.shape[0]
  u = jnp.arange(n, dtype=jnp.int32)
  owned = key < rows_here
  first = jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]]) & owned
  run = jnp.cumsum(first.astype(jnp.int32)) - 1
  count = run[-1] + 1
  num_owned = jnp.sum(owned.astype(jnp.int32))
  # Each run's first position, written once (distinct indices, no atomics).
  starts = jnp.full((n,), n, jnp.int32).at[jnp.where(first, run, n + u)].set(
      u, mode="drop", unique_indices=True)
  nxt = jnp.concatenate([starts[1:], jnp.full((1,), n, jnp.int32)])
  ends = jnp.where(u + 1 < count, nxt, num_owned)
  starts = jnp.where(u < count, starts, num_owned)
  ends = jnp.where(u < count, ends, num_owned)
  rows = jnp.where(u < count, key[jnp.minimum(starts, n - 1)], rows_here + u)
  return starts, ends, rows


def update(rule, table, slots, key, position, grads, lr, step, *, plan, first_col, xla_ops):
  """The update of ``sorted_update.local_update`` from its sort on, by the kernel on CUDA.

  Args:
    rule: a rule `supports` takes.
    table: this rank's shard ``[rows_here, cols_here]`` float32.
    slots: slot name -> this rank's slot shard.
    key: ``[n]`` sorted local rows (``rows_here`` for ids this rank does not own).
    position: ``[n]`` each sorted key's index in ``grads``.
    grads: ``[n, features]``, all logical columns.
    lr, step: scalars.
    plan: the table's ``EmbeddingPlan``.
    first_col: this rank's first logical column (hidden and grid sharding;
      else 0).
    xla_ops: ``() -> (table, slots)``, the XLA ops' update: the branch of
      platforms other than CUDA and the CPU.

  Returns:
    ``(table, slots)`` with each touched owned row updated once.
  """
  kernel = lambda interpret: lambda: _by_kernel(
      rule, table, slots, key, position, grads, lr, step, plan=plan, first_col=first_col,
      interpret=interpret)
  return platforms.by_platform(cpu=kernel(True), gpu=kernel(False), default=xla_ops)


def _by_kernel(rule, table, slots, key, position, grads, lr, step, *, plan, first_col,
               interpret):
  name = _RULES[type(rule)]
  starts, ends, rows = _runs(key, table.shape[0])
  grads = grads.astype(jnp.float32)
  sq_grads = None
  if plan.strategy in options.COLUMN_SPLIT:
    if name == mosaic_update.ADAGRAD:
      sq_grads = grads
    cols_here = table.shape[1]
    grads = jnp.pad(grads, ((0, 0), (0, plan.padded_shape[1] - plan.features)))
    grads = lax.dynamic_slice_in_dim(grads, first_col, cols_here, axis=1)
  gather = lambda slot: slots[slot].at[rows].get(mode="fill", fill_value=0)
  out = dict(slots)
  per_run = ()
  if name == mosaic_update.ADAGRAD:
    per_run = (gather("acc"),)
  elif name == mosaic_update.ADAM:
    # The bias corrections by the rule's own expressions: the same bits.
    if rule.bias_correction == "row":
      count = gather("count") + 1
      out["count"] = slots["count"].at[rows].set(count, mode="drop", unique_indices=True)
      t = count.astype(jnp.float32)
    else:
      t = jnp.full(rows.shape, jnp.asarray(step, jnp.float32) + 1)
    per_run = (1 - rule.b1**t, 1 - rule.b2**t)
  table_slots = tuple(slots[k] for k in mosaic_update.TABLE_SLOTS[name])
  hyper = {k: float(getattr(rule, k, 0.0)) for k in ("eps", "b1", "b2")}
  # Every array an argument: ``platforms.on_gpu`` stages ``run`` as a jaxpr of its own.
  run = lambda table, grads, runs, lr, table_slots, per_run, sq_grads: (
      mosaic_update.fused_update(
          table, grads, *runs, lr, rule=name, table_slots=table_slots, per_run=per_run,
          sq_grads=sq_grads, features=plan.features, interpret=interpret, **hyper))
  args = (table, grads, (position, starts, ends, rows), jnp.asarray(lr, jnp.float32),
          table_slots, per_run, sq_grads)
  if interpret:
    table, new_slots, new_acc = run(*args)
  else:
    # The CPU branch beside it interprets the kernel (`update`).
    table, new_slots, new_acc = platforms.on_gpu(run, *args, name="fused_update", ordered=True)
  out.update(zip(mosaic_update.TABLE_SLOTS[name], new_slots))
  if new_acc is not None:
    acc = slots["acc"]
    out["acc"] = acc.at[rows].set(new_acc.astype(acc.dtype), mode="drop", unique_indices=True)
  return table, out
