"""The fused CPU update: dedup, sum, rule and write of the touched rows in one C++ pass.

On XLA:CPU the update of ``apply.py`` is a dozen ops, two of them
``[ids, features]`` buffers (the per-row sums and the increment) and their
zeroing, in a temporary block that glibc hands back fresh, page by page,
every step. ``kernels/cpu/row_update.cc`` does the same update as one XLA
FFI call per shard: it finds the distinct rows among the ids with a hash
table (ids-sized), sums each row's gradients in input order, and runs the
rule in place on the aliased table and slots, a few rows ahead of its cache
misses (``benchmarks/sparse_step.py`` times it beside the XLA ops). The
rows are split by range over XLA's intra-op threads, each row on one
thread, so the results do not depend on the number of threads.

It is used on CPU only, for float32 tables and the three rules of
``rules.py`` (not subclasses: they may change the math), where the CPU
kernels' library builds (``kernels/cpu_library.py``: a C++ compiler, and
``EMBEDLIB_CPU_KERNELS`` not ``0``); otherwise ``apply.py``'s XLA ops run,
with the same results up to float32 rounding (the sum of squares and
``powf`` may round an ulp differently).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from embedlib.kernels import cpu_library
from embedlib.optim import rules as rules_lib
from embedlib.optim import trace_switch

_switch = trace_switch.TraceSwitch()


def use(enabled: bool):
  """Within the block, traces use the fused CPU update (True) or the XLA ops (False).

  For tests and comparisons. The choice is made when a step is traced, so
  jax's caches are cleared on entry and exit: a function jitted before is
  traced again. Nests.
  """
  return _switch.use(enabled)


def enabled() -> bool:
  """Whether traces now use the fused update on CPU (see ``use``, ``cpu_library``)."""
  forced = _switch.forced()
  if forced is not None:
    return forced and cpu_library.library() is not None
  return cpu_library.available()


def supports(rule: rules_lib.RowRule, table: jax.Array, slots: dict) -> bool:
  """Whether the fused update handles this rule, table and slots (and is enabled)."""
  kinds = (rules_lib.SparseSGD, rules_lib.RowWiseAdagrad, rules_lib.LazyAdam)
  if type(rule) not in kinds or table.dtype != jnp.float32:
    return False
  # Exact slot dtypes as rules.py declares them; anything else keeps XLA ops.
  want = {name: slot.dtype for name, slot in rule.slots().items()}
  if any(slots[name].dtype != dtype for name, dtype in want.items()):
    return False
  return enabled()


def update(rule, table, slots, ids, grads, lr, step, *, first_row, first_col, features):
  """One shard's fused update: ``(table, slots)`` with the touched rows updated.

  Args:
    rule: a ``SparseSGD``, ``RowWiseAdagrad`` or ``LazyAdam``.
    table: ``[rows, cols]`` float32, this rank's shard.
    slots: slot name -> this rank's slot shard.
    ids: ``[n]`` int32 global ids (``-1`` invalid); ids outside
      ``[first_row, first_row + rows)`` are skipped.
    grads: ``[n, features]`` row gradients, all logical columns.
    lr, step: scalars (this step's learning rate; updates applied before).
    first_row, first_col: int32 scalars, the shard's first global row and
      logical column.
    features: static, the table's logical columns.

  Raises:
    RuntimeError: without the CPU kernels' library (``cpu_library.call``).
  """
  offsets = jnp.stack([jnp.asarray(first_row, jnp.int32), jnp.asarray(first_col, jnp.int32)])
  ids = jnp.asarray(ids, jnp.int32)
  grads = jnp.asarray(grads, jnp.float32)
  lr = jnp.asarray(lr, jnp.float32)
  tail = (ids, grads, offsets, lr)
  attrs = {"features": np.int64(features)}
  if isinstance(rule, rules_lib.SparseSGD):
    out = _call("embedlib_sgd", [table], tail, attrs)
    return out[0], dict(slots)
  if isinstance(rule, rules_lib.RowWiseAdagrad):
    table, acc = _call("embedlib_adagrad", [table, slots["acc"]], tail,
                       dict(attrs, eps=np.float32(rule.eps)))
    return table, {"acc": acc}
  attrs.update(
      b1=np.float32(rule.b1), one_minus_b1=np.float32(1 - rule.b1),
      b2=np.float32(rule.b2), one_minus_b2=np.float32(1 - rule.b2),
      eps=np.float32(rule.eps),
  )
  if rule.bias_correction == "row":
    table, m, v, count = _call(
        "embedlib_adam_row", [table, slots["m"], slots["v"], slots["count"]], tail, attrs)
    return table, {"m": m, "v": v, "count": count}
  table, m, v = _call("embedlib_adam_global", [table, slots["m"], slots["v"]],
                      tail + (jnp.asarray(step, jnp.int32),), attrs)
  return table, {"m": m, "v": v}


def _call(target, state, operands, attrs):
  """The FFI call, each of ``state`` updated in place (aliased to its result)."""
  return cpu_library.call(
      target, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state], *state, *operands,
      aliases={i: i for i in range(len(state))}, vary_like=state, **attrs)
