"""Training a model with dynamic tables through ``embedlib.optim``.

The rows of a ``DynamicEmbed`` are a routed or vocab ``ShardedEmbed``
(``emb.rows``), so ``embedlib.optim.value_and_grad`` and
``SparseAwareOptimizer`` train them row by row like any table: a lookup of
a non-resident id reads row ``-1`` (an invalid id), which gets no gradient.
A placed row is reset to its initial value during the lookup (a first
placement finds it there already); its optimizer slots are reset by
``reset_slots``, called between the gradient and the update::

    loss, grads = optim.value_and_grad(loss_fn)(model)
    dynamic.reset_slots(opt, model)
    opt.update(model, grads)

A table the optimizer trains densely (an output layer tied to the
embedding, as SASRec's) has its rows' slots in the dense optax state:
``reset_slots`` resets those rows there to the values the transformation's
``init`` gives them (Adam's moments to 0). Its step count, which Adam's
bias correction reads, is the whole model's and stays. The dense update
also moves the rows no id holds yet, so ``reset_slots`` marks them placed
(``placed_at`` 0) and their first placement draws them afresh.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib import _compat
from embedlib.dynamic.module import DynamicEmbed
from embedlib.table_paths import table_key


def reset_slots(optimizer, model) -> None:
  """Sets the optimizer slots of every row placed since the last call to their initial values.

  Args:
    optimizer: the model's ``embedlib.optim.SparseAwareOptimizer``.
    model: the model, holding ``DynamicEmbed`` modules anywhere.
  """
  keys = list(optimizer.keys)
  dense = []
  for path, module in nnx.iter_graph(model):
    if not isinstance(module, DynamicEmbed):
      continue
    key = table_key(tuple(path) + ("rows",))
    if key not in keys:
      dense.append((tuple(str(p) for p in path) + ("rows", "embedding"), module))
      continue
    fresh = module.placed_at[...] > module.slots_clock[...]
    slots = optimizer.slots[keys.index(key)]
    for name, slot in optimizer.rule.slots().items():
      value = slots[name][...]
      mask = fresh.reshape(fresh.shape + (1,) * (value.ndim - 1))
      _compat.assign(slots[name], jnp.where(mask, jnp.asarray(slot.init, value.dtype), value))
    _compat.assign(module.slots_clock, module.clock[...])
  if dense and getattr(optimizer, "dense", None) is not None:
    _reset_dense_slots(optimizer.dense, model, dense)


def _key_names(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _reset_dense_slots(dense, model, tables) -> None:
  """``reset_slots`` for tables in the dense ``nnx.Optimizer``'s optax state.

  The state's leaves for a parameter sit at its path (under the
  transformation's own keys), and ``tx.init`` of the same parameters gives
  the same tree, so the fresh values are read at the same place; under
  ``jit`` only the rows' leaves of that tree are ever computed.
  """
  is_var = lambda x: isinstance(x, nnx.Variable)
  state = jax.tree_util.tree_flatten_with_path(dense.opt_state, is_leaf=is_var)[0]
  init = jax.tree.leaves(dense.tx.init(nnx.state(model, dense.wrt)), is_leaf=is_var)
  for (path, leaf), first in zip(state, init):
    names = _key_names(path)
    for suffix, module in tables:
      if names[-len(suffix):] != suffix or not is_var(leaf):
        continue
      value = leaf[...]
      fresh = module.placed_at[...] > module.slots_clock[...]
      mask = fresh.reshape(fresh.shape + (1,) * (value.ndim - 1))
      first = first[...] if is_var(first) else first
      _compat.assign(leaf, jnp.where(mask, jnp.asarray(first, value.dtype), value))
  for _, module in tables:
    _compat.assign(module.slots_clock, module.clock[...])
    # The dense update changes the unplaced rows: their first placement draws them.
    _compat.assign(module.placed_at, jnp.maximum(module.placed_at[...], 0))


def step_stats(model) -> dict[str, float]:
  """Every dynamic table's last training step, flat, for a metrics writer.

  Keys are ``dynamic/<table path>/<stat>`` with the stats of
  ``DynamicEmbed.stats`` (occupancy, admitted, evicted, default_share); the
  trainer writes them beside the loss.

  >>> import numpy as np
  >>> emb = DynamicEmbed(128, 2, rngs=nnx.Rngs(0))
  >>> _ = emb.rows_of(np.array([7, 8, 7]))
  >>> step_stats(nnx.Dict({"users": emb}))["dynamic/users/admitted"]
  2
  """
  out = {}
  for path, module in nnx.iter_graph(model):
    if isinstance(module, DynamicEmbed):
      key = table_key(path) or module.name
      for name, value in module.stats().items():
        out[f"dynamic/{key}/{name}"] = value
  return out


@contextlib.contextmanager
def frozen_maps(model):
  """Inside, every dynamic table of ``model`` only looks ids up (as after ``eval()``).

  For an evaluation: its ids are neither admitted nor counted, and the rest
  of the model (dropout and the like) keeps its mode.
  """
  tables = [m for _, m in nnx.iter_graph(model) if isinstance(m, DynamicEmbed)]
  before = [m.deterministic for m in tables]
  for m in tables:
    m.deterministic = True
  try:
    yield
  finally:
    for m, was in zip(tables, before):
      m.deterministic = was
