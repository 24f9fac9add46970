"""The fused GPU update: after the sort, one Mosaic GPU kernel reduces each run and applies the rule.

``sorted_update.local_update`` sorts the ids; for the rules and tables the
kernel takes (`supports`) the runs of equal rows go to
``kernels/mosaic_update.py``, which sums each run's gradients in order and
updates its table row in place, instead of the scan, the rule over every
sorted position and the writes of the XLA ops. Elsewhere (LazyAdam, other
dtypes, rows that are not whole 16-byte units, hidden sharding, jax 0.10)
the XLA ops run.

The kernel is compiled into the CUDA branch of the step; the CPU runs the
XLA ops unless `use` (True) makes it interpret the kernel, for tests.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from embedlib import options
from embedlib.kernels import mosaic_update, platforms
from embedlib.optim import rules as rules_lib

_forced: list[bool] = []

#: The rules the kernel implements (exact types: a subclass may change the math).
_RULES = {rules_lib.SparseSGD: mosaic_update.SGD, rules_lib.RowWiseAdagrad: mosaic_update.ADAGRAD}


@contextlib.contextmanager
def use(enabled: bool):
  """Within the block, traces run the fused kernel on every platform (True) or none (False).

  True makes the CPU interpret the kernel (Mosaic GPU's interpreter, jax >=
  0.11) where ``sorted_update`` runs; False gives CUDA ``sorted_update``'s
  XLA ops, for comparisons. The choice is made when a step is traced, so
  jax's caches are cleared on entry and exit. Nests.
  """
  _forced.append(bool(enabled))
  jax.clear_caches()
  try:
    yield
  finally:
    _forced.pop()
    jax.clear_caches()


def supports(rule, table, plan) -> bool:
  """Whether the kernel updates this shard with this rule (and is not turned off by `use`)."""
  if _forced and not _forced[-1]:
    return False
  return (type(rule) in _RULES and plan.strategy != options.HIDDEN
          and table.shape[1] == plan.features and mosaic_update.supports(table.shape, table.dtype))


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


def update(rule, table, slots, key, position, grads, lr, *, plan, xla_ops):
  """The update of ``sorted_update.local_update`` from its sort on, by the kernel on CUDA.

  Args:
    rule: a rule `supports` takes.
    table: this rank's shard ``[rows_here, features]`` float32.
    slots: slot name -> this rank's slot shard.
    key: ``[n]`` sorted local rows (``rows_here`` for ids this rank does not own).
    position: ``[n]`` each sorted key's index in ``grads``.
    grads: ``[n, features]``.
    lr: scalar.
    plan: the table's ``EmbeddingPlan``.
    xla_ops: ``() -> (table, slots)``, the XLA ops' update: the other
      platforms' branch (and the CPU's, unless `use` (True)).

  Returns:
    ``(table, slots)`` with each touched owned row updated once.
  """
  interpreted = bool(_forced) and _forced[-1]
  kernel = lambda interpret: lambda: _by_kernel(
      rule, table, slots, key, position, grads, lr, plan=plan, interpret=interpret)
  return platforms.by_platform(
      cpu=kernel(True) if interpreted else xla_ops, gpu=kernel(False), default=xla_ops)


def _by_kernel(rule, table, slots, key, position, grads, lr, *, plan, interpret):
  starts, ends, rows = _runs(key, table.shape[0])
  acc = slots.get("acc")
  old = (acc.at[rows].get(mode="fill", fill_value=0) if acc is not None
         else jnp.zeros(rows.shape, jnp.float32))
  args = (table, grads.astype(jnp.float32), position, starts, ends, rows, old,
          jnp.asarray(lr, jnp.float32))
  run = lambda *a: mosaic_update.fused_update(
      *a, rule=_RULES[type(rule)], eps=float(getattr(rule, "eps", 0.0)),
      features=plan.features, interpret=interpret)
  if interpret:
    table, new = run(*args)
  else:
    # A CPU branch beside it interprets Mosaic kernels only under `use`.
    table, new = platforms.on_gpu(run, *args, name="fused_update",
                                  ordered=bool(_forced) and _forced[-1])
  out = dict(slots)
  if acc is not None:
    out["acc"] = acc.at[rows].set(new.astype(acc.dtype), mode="drop", unique_indices=True)
  return table, out
