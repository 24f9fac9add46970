"""The fused GPU update: after the sort, one kernel reduces each run and applies the rule.

``sorted_update.local_update`` sorts the ids; for the rules and tables the
kernel takes (`supports`) the runs of equal rows go to
``kernels/mosaic_update.py`` (Mosaic GPU) or ``kernels/update_rows.py``
(Triton, many rows in flight), which sum each run's gradients in order and
update its table row (and Adam's moments) in place, instead of the scan,
the rule over every sorted position and the writes of the XLA ops. Every
strategy runs the Mosaic kernel: a row-sharded or replicated rank updates its rows, a
hidden-sharded one its column slice of every touched row, a grid one its
column slice of its touched rows (the slice of the
gradients goes in, and for AdaGrad the whole rows too, for the row's sum of
squares). Elsewhere (other rules or dtypes, rows that are not whole 16-byte
units, rows too wide for shared memory, jax 0.10) the XLA ops run.

On an H200 the Mosaic kernel took longer than the sorted XLA ops it
replaces for every rule (``benchmarks/README.md``, "GPU sparse update and
steps"), so a step runs it only inside `use` (True), which compiles it into
the CUDA branch of the step and makes the CPU interpret it, for tests and
benchmarks; `use` ("triton") does the same with the Triton kernel. Outside
any `use` block, a CUDA step runs the Triton kernel where the newest GPU
sweep measured it faster for the rule and width
(``kernels/gpu_choice.py``, kinds ``update-<rule>``), with the measured
variant; the XLA ops everywhere else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from embedlib import options
from embedlib.kernels import gpu_choice, mosaic_update, platforms, update_rows
from embedlib.kernels.rows import SegmentVariant
from embedlib.optim import rules as rules_lib
from embedlib.optim import trace_switch

_switch = trace_switch.TraceSwitch()

#: The rules the kernel implements (exact types: a subclass may change the math).
_RULES = {rules_lib.SparseSGD: mosaic_update.SGD, rules_lib.RowWiseAdagrad: mosaic_update.ADAGRAD,
          rules_lib.LazyAdam: mosaic_update.ADAM}


MOSAIC, TRITON = "mosaic", "triton"


def use(enabled):
  """Within the block, traces run a fused kernel on every platform (True, "triton") or none (False).

  True (or ``"mosaic"``) compiles the Mosaic kernel for CUDA and makes the
  CPU interpret it (Mosaic GPU's interpreter, jax >= 0.11) where
  ``sorted_update`` runs; ``"triton"`` the Triton kernel (Pallas's
  interpreter on the CPU, any jax), a Triton variant's name
  (``"triton-rows-segment-..."``, `SegmentVariant`) that variant of it; False
  gives ``sorted_update``'s XLA ops on every platform. The choice is made
  when a step is traced, so jax's caches are cleared on entry and exit. Nests.
  """
  if isinstance(enabled, str) and enabled.startswith(gpu_choice.RUNNABLE):
    SegmentVariant.parse(enabled)   # a bad name fails here, not at trace time
  elif enabled not in (True, False, MOSAIC, TRITON):
    raise ValueError(f"fused_gpu.use({enabled!r}): pass True or 'mosaic', 'triton' (or a "
                     f"variant's name, {SegmentVariant().name!r}), or False.")
  return _switch.use(MOSAIC if enabled is True else enabled)


def _choice(rule, table, plan, slots):
  """``(backend, variant)`` of the fused update for this shard, or None for the XLA ops.

  ``variant``: the Triton kernel's `SegmentVariant` (None for Mosaic's).
  """
  forced = _switch.forced()
  if forced is False or type(rule) not in _RULES:
    return None
  name = _RULES[type(rule)]
  sliced = plan.strategy in options.COLUMN_SPLIT   # a slice of each row's columns
  if not sliced and table.shape[1] != plan.features:
    return None
  table_slots = mosaic_update.TABLE_SLOTS[name]
  if slots is not None and any(slots[k].dtype != jnp.float32 for k in table_slots):
    return None
  # A column slice's AdaGrad also sums the whole rows, for their squares.
  sq_width = plan.features if sliced and name == mosaic_update.ADAGRAD else 0
  if forced is None:
    variant = gpu_choice.choose(f"update-{name}", table.shape[1], table.dtype)
    if variant is None or not variant.startswith(gpu_choice.RUNNABLE):
      return None
    backend, variant = TRITON, SegmentVariant.parse(variant)
  elif forced == MOSAIC:
    backend, variant = MOSAIC, None
  else:
    backend = TRITON
    variant = SegmentVariant() if forced == TRITON else SegmentVariant.parse(forced)
  kernel = mosaic_update if backend == MOSAIC else update_rows
  if not kernel.supports(table.shape, table.dtype, rule=name, sq_width=sq_width):
    return None
  return backend, variant


def supports(rule, table, plan, slots=None) -> bool:
  """Whether a fused kernel updates this shard with this rule (inside `use`, or as measured faster).

  ``slots``: this shard's slots, by name; the kernels take float32 table slots.
  """
  return _choice(rule, table, plan, slots) is not None


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
  backend, variant = _choice(rule, table, plan, slots)
  kernel = lambda interpret: lambda: _by_kernel(
      rule, table, slots, key, position, grads, lr, step, plan=plan, first_col=first_col,
      backend=backend, variant=variant, interpret=interpret)
  # Outside `use`, only CUDA runs the kernel (as measured faster there).
  cpu = kernel(True) if _switch.forced() else xla_ops
  return platforms.by_platform(cpu=cpu, gpu=kernel(False), default=xla_ops)


def _by_kernel(rule, table, slots, key, position, grads, lr, step, *, plan, first_col,
               backend, variant, interpret):
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
  extra = {} if backend == MOSAIC else {"variant": variant}
  kernel = mosaic_update if backend == MOSAIC else update_rows
  # Every array an argument: ``platforms.on_gpu`` stages ``run`` as a jaxpr of its own.
  run = lambda table, grads, runs, lr, table_slots, per_run, sq_grads: (
      kernel.fused_update(
          table, grads, *runs, lr, rule=name, table_slots=table_slots, per_run=per_run,
          sq_grads=sq_grads, features=plan.features, interpret=interpret, **hyper, **extra))
  args = (table, grads, (position, starts, ends, rows), jnp.asarray(lr, jnp.float32),
          table_slots, per_run, sq_grads)
  if interpret:
    table, new_slots, new_acc = run(*args)
  else:
    # Beside a CPU branch that interprets the Mosaic kernel (`update`), its ordered effect.
    ordered = backend == MOSAIC and _switch.forced() == MOSAIC
    table, new_slots, new_acc = platforms.on_gpu(run, *args, name="fused_update", ordered=ordered)
  out.update(zip(mosaic_update.TABLE_SLOTS[name], new_slots))
  if new_acc is not None:
    acc = slots["acc"]
    out["acc"] = acc.at[rows].set(new_acc.astype(acc.dtype), mode="drop", unique_indices=True)
  return table, out
