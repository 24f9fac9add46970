"""Dense single-device references of the row-wise rules, and the test layouts.

The references are written over the whole logical table with numpy (float64)
and a touched-row mask, independently of ``embedlib.optim.rules``: a touched
row is one with at least one valid id in the batch, whatever its gradient.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from embedlib import axes
from embedlib import options
from embedlib.optim import LazyAdam, RowWiseAdagrad, SparseSGD

#: (mesh shape, axis names, sharding, table_axes, data_axes); shape None is
#: no mesh. Token-sharded layouts are those whose data axes overlap the
#: table axes (every ("batch",) mesh, and the 2-D tables over both axes).
#: A grid needs two groups of axes: rows over "model", columns over "data".
LAYOUTS = [(None, None, options.REPLICATED, None, None)]
for _n in (1, 2, 4, 8):
  for _s in options.STRATEGIES:
    if _s == options.GRID:
      continue
    LAYOUTS.append(((_n,), (axes.BATCH,), _s, None, None))
for _s in options.STRATEGIES:
  LAYOUTS.append(((2, 4), (axes.DATA, axes.MODEL), _s, None, None))
for _s in (options.VOCAB, options.HIDDEN, options.ROUTED):
  LAYOUTS.append(((2, 4), (axes.DATA, axes.MODEL), _s, (axes.DATA, axes.MODEL), None))

#: The layouts the local update paths are compared on (test_dense_path's
#: by-rows, marks and sort dedups; test_rules' fused and sorted updates): every strategy without a mesh, on 2 and 8 devices (13
#: rows pad to 14 and 16) and on the 2-D meshes. The 1-device mesh pads
#: nothing, like no mesh, and the 4-device one pads as 8 does: the paths
#: treat neither apart. test_rules still runs every layout.
PATH_LAYOUTS = [layout for layout in LAYOUTS
                if layout[0] is None or len(layout[0]) > 1 or layout[0][0] in (2, 8)]


def layout_id(layout) -> str:
  shape, _, strategy, table_axes, _ = layout
  mesh = "x".join(map(str, shape)) if shape else "nomesh"
  return f"{strategy}-{mesh}" + ("-both" if table_axes else "")


def make_mesh(layout):
  shape, names = layout[0], layout[1]
  if shape is None:
    return None
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, devices=jax.devices()[:n])


#: Rules under test; hyperparameters away from the defaults so a rule that
#: ignored one would fail.
def make_rule(name: str, schedule: bool):
  lr = optax.exponential_decay(0.3, 1, 0.5) if schedule else 0.2
  return {
      "sgd": lambda: SparseSGD(lr),
      "adagrad": lambda: RowWiseAdagrad(lr, eps=1e-3, initial_accumulator_value=0.05),
      "adam_row": lambda: LazyAdam(lr, b1=0.8, b2=0.95, eps=1e-4),
      "adam_global": lambda: LazyAdam(lr, b1=0.8, b2=0.95, eps=1e-4, bias_correction="global"),
  }[name]()


RULES = ("sgd", "adagrad", "adam_row", "adam_global")
#: The rules every layout runs.
LAYOUT_RULES = ("sgd", "adagrad", "adam_row")


def init_slots(rule, num_embeddings, features):
  """Logical slots (no padding), float64."""
  out = {}
  for name, slot in rule.slots().items():
    shape = (num_embeddings, features) if slot.kind == "table" else (num_embeddings,)
    out[name] = np.full(shape, slot.init, np.float64)
  return out


def dense_step(rule, table, slots, pairs, step):
  """One dense-reference step from ``(ids, row_grads)`` pairs.

  Returns:
    ``(table, slots, touched)``.
  """
  n, f = np.shape(table)
  grad = np.zeros((n, f))
  touched = np.zeros(n, bool)
  for ids, g in pairs:
    ids = np.asarray(ids).reshape(-1)
    g = np.asarray(g, np.float64).reshape(-1, f)
    ok = (ids >= 0) & (ids < n)
    np.add.at(grad, ids[ok], g[ok])
    touched[ids[ok]] = True
  return dense_update(rule, table, slots, grad, touched, step) + (touched,)


def dense_update(rule, table, slots, grad, touched, step):
  """The rule on every ``touched`` row of a dense table gradient.

  Returns:
    ``(table, slots)``, float64.
  """
  table = np.asarray(table, np.float64).copy()
  slots = {k: v.copy() for k, v in slots.items()}
  grad = np.asarray(grad, np.float64)
  lr = float(rule.learning_rate(step)) if callable(rule.learning_rate) else rule.learning_rate
  t, g = touched, grad[touched]
  if isinstance(rule, SparseSGD):
    table[t] -= lr * g
  elif isinstance(rule, RowWiseAdagrad):
    slots["acc"][t] += np.mean(g * g, axis=1)
    table[t] -= lr * g / (np.sqrt(slots["acc"][t])[:, None] + rule.eps)
  elif isinstance(rule, LazyAdam):
    slots["m"][t] = rule.b1 * slots["m"][t] + (1 - rule.b1) * g
    slots["v"][t] = rule.b2 * slots["v"][t] + (1 - rule.b2) * g * g
    if rule.bias_correction == "row":
      slots["count"][t] += 1
      k = slots["count"][t][:, None]
    else:
      k = step + 1
    m_hat = slots["m"][t] / (1 - rule.b1**k)
    v_hat = slots["v"][t] / (1 - rule.b2**k)
    table[t] -= lr * m_hat / (np.sqrt(v_hat) + rule.eps)
  else:
    raise TypeError(rule)
  return table, slots
