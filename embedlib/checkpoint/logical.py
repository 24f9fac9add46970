"""Training state split for a checkpoint: dense arrays as they are, tables at logical shapes.

A checkpoint must not depend on the layout it was saved from: a run saved on
8 devices restores onto 4, 3 or 1, where padding and sharding differ. So
every table and every sparse optimizer slot is stored at its logical shape
(``num_embeddings`` rows, ``features`` columns), written and read shard by
shard (``sharded.py``): no device ever holds a whole table. The dense
parameters, optax state and step counters are stored as they are (their
shapes never depend on the mesh).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from embedlib.checkpoint.sharded import Logical
from embedlib.optim import row_grads


def _slot_logical_shape(value, plan) -> tuple[int, ...]:
  rows, cols = plan.logical_shape
  return (rows,) if value.ndim == 1 else (rows, cols)


def _host(x):
  """A host copy of a dense (small) array, for orbax to write from process 0.

  Handing orbax the replicated device arrays instead makes it slice each
  into one piece per replica, compiling a program per array and device.
  """
  if not isinstance(x, jax.Array):
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _dense_tree(model, optimizer) -> dict:
  keys = frozenset(optimizer.keys)
  tree = {"dense": nnx.to_pure_dict(nnx.state(model, row_grads.NotTables(keys))),
          "step": optimizer.step[...]}
  if optimizer.dense is not None:
    tree["dense_opt"] = nnx.to_pure_dict(nnx.state(optimizer.dense))
  return tree


def _sharded_variables(model, optimizer) -> dict:
  """``{name: (nnx variable, logical shape)}`` of every table and slot."""
  found = dict(row_grads.sparse_tables(model, optimizer.tables))
  out = {}
  for key, slots in zip(optimizer.keys, optimizer.slots):
    emb = found[key]
    out[f"tables/{key}"] = (emb.embedding, emb.plan.logical_shape)
    for slot_name, slot in slots.items():
      out[f"slots/{key}/{slot_name}"] = (slot, _slot_logical_shape(slot[...], emb.plan))
  return out


def split_state(model: nnx.Module, optimizer) -> tuple[dict, dict[str, Logical]]:
  """The state to save, without copying or gathering anything.

  Args:
    model: an ``nnx.Module`` holding ``ShardedEmbed`` tables (directly or in
      an ``EmbeddingCollection``).
    optimizer: the ``SparseAwareOptimizer`` built for it.

  Returns:
    ``(dense, sharded)``: ``dense`` is ``{"dense", "step", "dense_opt"}``, a
    pytree of host (numpy) copies; ``sharded`` maps ``"tables/<key>"`` and
    ``"slots/<key>/<slot>"`` to the padded arrays and their logical shapes.
  """
  sharded = {name: Logical(var[...], tuple(shape))
             for name, (var, shape) in _sharded_variables(model, optimizer).items()}
  return jax.tree.map(_host, _dense_tree(model, optimizer)), sharded


def restore_targets(model: nnx.Module, optimizer) -> tuple[dict, dict[str, Logical]]:
  """``split_state``'s structure as ``ShapeDtypeStruct`` targets on ``model``'s layout."""
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  sharded = {name: Logical(abstract(var[...]), tuple(shape))
             for name, (var, shape) in _sharded_variables(model, optimizer).items()}
  return jax.tree.map(abstract, _dense_tree(model, optimizer)), sharded


def load_state(model: nnx.Module, optimizer, dense: dict, sharded: dict) -> None:
  """Puts restored arrays (on ``restore_targets``' layout) into the model and optimizer."""
  state = nnx.state(model, row_grads.NotTables(frozenset(optimizer.keys)))
  nnx.replace_by_pure_dict(state, dense["dense"])
  nnx.update(model, state)
  for name, (var, _) in _sharded_variables(model, optimizer).items():
    var.set_value(sharded[name])
  optimizer.step.set_value(dense["step"])
  if optimizer.dense is not None:
    state = nnx.state(optimizer.dense)
    nnx.replace_by_pure_dict(state, dense["dense_opt"])
    nnx.update(optimizer.dense, state)
