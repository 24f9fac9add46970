"""Training state split for a checkpoint: dense arrays as they are, tables at logical shapes.

A checkpoint must not depend on the layout it was saved from: a run saved on
8 devices restores onto 4, 3 or 1, where padding and sharding differ. So
every table and every sparse optimizer slot is stored at its logical shape
(``num_embeddings`` rows, ``features`` columns), written and read shard by
shard (``sharded.py``): no device ever holds a whole table. The dense
parameters, optax state and step counters are stored as they are (their
shapes never depend on the mesh).

A stack of tables (an ``EmbeddingCollection``'s table-wise and
table-row-wise placements) is stored member by member, under the name each
member has as a table of its own in the same collection
(``<collection>/tables/<name>``), each read from and written to the rows
its placement gives it: a checkpoint restores across placements as across
device counts.

A dynamic table's map (``embedlib.DynamicEmbed``: keys, scores, placement
clocks, sketch) is split over its devices by whole buckets, and is stored
the same way, shard by shard (``maps/<key>/<field>``): a restore onto
another device count hands each device its new buckets.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from embedlib import host_memory
from embedlib import param as param_lib
from embedlib.checkpoint.sharded import Logical, Stacked
from embedlib.dynamic import module as dynamic_module
from embedlib.optim import row_grads
from embedlib.table_paths import table_key

#: The split fields of a ``DynamicEmbed``'s map, stored shard by shard.
MAP_FIELDS = ("keys_hi", "keys_lo", "score", "placed_at", "sketch")


def _map_variables(model) -> dict[tuple, nnx.Variable]:
  """Path -> variable of every split map field of the model's dynamic tables."""
  out = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, dynamic_module.DynamicEmbed):
      for field in MAP_FIELDS:
        if getattr(node, field, None) is not None:
          out[tuple(path) + (field,)] = getattr(node, field)
  return out


@dataclasses.dataclass(frozen=True)
class _NotPaths:
  """An nnx filter: every variable but those at ``paths``."""

  paths: frozenset

  def __call__(self, path, value) -> bool:
    del value
    return tuple(path) not in self.paths


def _dense_filter(model, optimizer):
  return nnx.All(row_grads.NotTables(frozenset(optimizer.keys)),
                 _NotPaths(frozenset(_map_variables(model))))


@dataclasses.dataclass(frozen=True)
class ModelOnly:
  """Stands for a ``SparseAwareOptimizer`` where only the model is restored (serving, export).

  Which tables a run's row-wise rule trained decides where the checkpoint
  holds them (``tables/<key>``, shard by shard, or in the dense state);
  their slots, the optax state and the step are neither built nor read.

  Args:
    keys: the optimizer's ``keys`` (the row-wise rule's tables); ``()`` for
      a run whose tables all trained densely.
  """

  keys: tuple[str, ...]
  tables = None  # every ShardedEmbed: keys picks the rule's
  dense = None
  step = None

  @property
  def slots(self) -> tuple[dict, ...]:
    return tuple({} for _ in self.keys)


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


def member_key(stack_key: str, member: str) -> str:
  """A stack member's key: ``<collection>/tables/<member>`` for ``<collection>/stacks/<stack>``.

  >>> member_key("embeddings/stacks/stack_16", "country")
  'embeddings/tables/country'
  """
  return "/".join(stack_key.split("/")[:-2] + ["tables", member])


def _logical_leaf(x):
  return param_lib.logical(x) if isinstance(x, nnx.Variable) else x


def _dense_tree(model, optimizer) -> dict:
  """The dense state, a padded table and its optax slots at their logical shape.

  A table the dense optimizer trains (a tied item table) is padded to its
  shard group, and so are the slots ``nnx.Optimizer`` built from it; stored
  padded, they would fit only the device count they were saved from.
  """
  dense = nnx.state(model, _dense_filter(model, optimizer))
  tree = {"dense": nnx.to_pure_dict(dense, _logical_leaf)}
  if optimizer.step is not None:
    tree["step"] = optimizer.step[...]
  if optimizer.dense is not None:
    tree["dense_opt"] = nnx.to_pure_dict(nnx.state(optimizer.dense), _logical_leaf)
  return tree


def _stored(name: str, key: str, emb, array, shape) -> Logical | Stacked:
  """``array`` (a table or slot of ``emb``) as stored: whole, or per stack member."""
  placement = emb.plan.placement
  if placement is None:
    return Logical(array, tuple(shape))
  members = {}
  for member, rows in placement.members:
    first = placement.start(member)
    runs = tuple((l - first, n, p) for l, n, p in placement.segments
                 if first <= l < first + rows)
    stored_name = name.replace(key, member_key(key, member), 1)
    members[stored_name] = Logical(array, (rows,) + tuple(shape[1:]), runs)
  return Stacked(array, members)


def _sharded_items(model, optimizer, value) -> dict:
  """``{name: Logical | Stacked}`` of every table and slot, ``value(variable)`` as the array."""
  found = dict(row_grads.sparse_tables(model, optimizer.tables))
  out = {}
  for key, slots in zip(optimizer.keys, optimizer.slots):
    emb = found[key]
    name = f"tables/{key}"
    out[name] = _stored(name, key, emb, value(emb.embedding), emb.plan.logical_shape)
    for slot_name, slot in slots.items():
      name = f"slots/{key}/{slot_name}"
      out[name] = _stored(name, key, emb, value(slot),
                          _slot_logical_shape(slot[...], emb.plan))
  for path, variable in _map_variables(model).items():
    out["maps/" + table_key(path)] = Logical(value(variable), tuple(variable.shape))
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
    ``"slots/<key>/<slot>"`` (a stack's members by their own keys) to the
    padded arrays and their logical shapes.
  """
  items = _sharded_items(model, optimizer, param_lib.physical)
  sharded = {}
  for name, item in items.items():
    sharded.update(item.members if isinstance(item, Stacked) else {name: item})
  return jax.tree.map(_host, _dense_tree(model, optimizer)), sharded


def restore_targets(model: nnx.Module, optimizer) -> tuple[dict, dict]:
  """``split_state``'s structure as ``ShapeDtypeStruct`` targets on ``model``'s layout.

  A stack's table and slots are ``Stacked`` targets, read from their members.

  Args:
    model: the model to restore into, on the mesh to restore onto.
    optimizer: its ``SparseAwareOptimizer``.

  Returns:
    ``(dense, sharded)``: targets of the dense state (parameters other than
    tables, the optax state and the step) and ``{name: target}`` of each
    table and slot at its logical shape.
  """
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  sharded = _sharded_items(model, optimizer, lambda var: abstract(param_lib.physical(var)))
  return jax.tree.map(abstract, _dense_tree(model, optimizer)), sharded


def padded_slot_targets(optimizer) -> dict:
  """``{"dense_opt/...": target}`` of each padded table's optax slot at its stored (padded) shape.

  What an embedlib before logical dense slots saved them as
  (``Checkpointer`` reads such a checkpoint onto the layout it came from).
  """
  if optimizer.dense is None:
    return {}
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(optimizer.dense)):
    layout = var.get_metadata(param_lib.LAYOUT, None)
    if layout is not None and not layout.identity:
      raw = param_lib.physical(var)
      out["/".join(["dense_opt", *map(str, path)])] = jax.ShapeDtypeStruct(
          raw.shape, raw.dtype, sharding=raw.sharding)
  return out


def table_loader(model: nnx.Module, optimizer):
  """``load(name, array)``: puts one restored table or slot into the model or optimizer.

  Restoring through it replaces each table as it is read, so the old one is
  freed before the next is read: one table held twice at most, where reading
  them all first holds every table twice.
  """
  variables = _sharded_items(model, optimizer, lambda var: var)

  def load(name: str, array) -> None:
    param_lib.set_physical(variables[name].array, array)
    host_memory.release_freed()  # the replaced table's pages, before the next is read
  return load


def load_state(model: nnx.Module, optimizer, dense: dict, sharded: dict | None = None) -> None:
  """Puts restored arrays (on ``restore_targets``' layout) into the model and optimizer.

  Args:
    model: the model the targets were made from.
    optimizer: its ``SparseAwareOptimizer`` (or ``ModelOnly``).
    dense: the restored dense state.
    sharded: the restored tables and slots; None when they are already in
      (restored through ``table_loader``, one at a time).
  """
  state = nnx.state(model, _dense_filter(model, optimizer))
  nnx.replace_by_pure_dict(state, dense["dense"])
  nnx.update(model, state)
  load = table_loader(model, optimizer)
  for name, array in (sharded or {}).items():
    load(name, array)
  if optimizer.step is not None:
    optimizer.step.set_value(dense["step"])
  if optimizer.dense is not None:
    state = nnx.state(optimizer.dense)
    nnx.replace_by_pure_dict(state, dense["dense_opt"])
    nnx.update(optimizer.dense, state)
  _lay_out_dense_tables(model)
  if optimizer.dense is not None:
    _lay_out_dense_tables(optimizer.dense)


def _lay_out_dense_tables(module) -> None:
  """Stores padded again the tables (and their optax slots) a dense restore set logical.

  A table trained by the dense optimizer (``SparseAwareOptimizer(sparse=
  None)``, or a tied table outside the sparse rule) is saved, with its
  optax slots, as its logical view (``_dense_tree``), and ``nnx.update``
  sets that as the raw value; the train step was compiled for the physical
  layout, and optax needs the parameter and its slots alike. Padding rows
  and columns come back zero, as a fresh slot's are.
  """
  for _, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Variable) and node.get_metadata(param_lib.LAYOUT, None) is not None:
      param_lib.set_physical(node, param_lib.physical(node))
