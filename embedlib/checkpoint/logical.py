"""Training state in logical (unpadded) form, and back onto any mesh.

A checkpoint must not depend on the layout it was saved from: a run saved on
8 devices restores onto 4, 3 or 1, where padding and sharding differ. So the
saved tree holds every table and every sparse optimizer slot at its logical
shape (``num_embeddings`` rows, ``features`` columns), replicated, and the
dense parameters and optax state as they are (their shapes never depend on
the mesh). Loading pads and lays each array out for the new model.

A stack of tables (an ``EmbeddingCollection``'s table-wise and
table-row-wise placements) is saved member by member, under the key each
member has as a table of its own in the same collection
(``<collection>/tables/<name>``): a checkpoint restores across placements
as across device counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import sharding as sharding_lib
from embedlib.optim import apply as apply_lib
from embedlib.optim import row_grads
from embedlib.strategies import rowmap


def _unpad(x, logical_shape, mesh):
  if x.shape == logical_shape:
    return x
  if mesh is not None:
    x = sharding_lib.place_always(x, NamedSharding(mesh, P()))
  return x[tuple(slice(0, n) for n in logical_shape)]


def _slot_logical_shape(value, plan):
  rows, cols = plan.logical_shape
  return (rows,) if value.ndim == 1 else (rows, cols)


def _pad_and_place(x, shape, spec, mesh):
  x = jnp.pad(x, [(0, p - n) for n, p in zip(x.shape, shape)])
  if mesh is None:
    return x
  return sharding_lib.place_always(x, NamedSharding(mesh, P(*spec)))


def member_key(stack_key: str, member: str) -> str:
  """A stack member's key: ``<collection>/tables/<member>`` for ``<collection>/stacks/<stack>``.

  >>> member_key("embeddings/stacks/stack_16", "country")
  'embeddings/tables/country'
  """
  return "/".join(stack_key.split("/")[:-2] + ["tables", member])


def _parts(key, emb):
  """``(logical key, first row, rows)`` of each table a module holds."""
  placement = emb.plan.placement
  if placement is None:
    return [(key, 0, emb.plan.num_embeddings)]
  return [(member_key(key, m), placement.start(m), rows) for m, rows in placement.members]


def _logical_rows(x, emb):
  """A table or row slot of ``emb`` in logical rows (stacks: members in order)."""
  if emb.plan.placement is None:
    return _unpad(x, _slot_logical_shape(x, emb.plan) if x.ndim == 1 else emb.plan.logical_shape,
                  emb.mesh)
  if emb.mesh is not None:
    x = sharding_lib.place_always(x, NamedSharding(emb.mesh, P()))
  return rowmap.to_logical(x, emb.plan)


def _split(key, emb, x):
  return {k: x[start:start + rows] for k, start, rows in _parts(key, emb)}


def _joined(key, emb, tree):
  parts = [tree[k] for k, _, _ in _parts(key, emb)]
  return parts[0] if len(parts) == 1 else jnp.concatenate([jnp.asarray(p) for p in parts])


def logical_state(model: nnx.Module, optimizer) -> dict:
  """The layout-free training state of ``model`` and its optimizer.

  Args:
    model: an ``nnx.Module`` holding ``ShardedEmbed`` tables (directly or in
      an ``EmbeddingCollection``).
    optimizer: the ``SparseAwareOptimizer`` built for it.

  Returns:
    ``{"dense", "tables", "slots", "dense_opt", "step"}``, a pytree of arrays.
  """
  found = dict(row_grads.sparse_tables(model, optimizer.tables))
  keys = optimizer.keys
  dense = nnx.state(model, row_grads.NotTables(frozenset(keys)))
  tables, slot_tree = {}, {}
  for k, slots in zip(keys, optimizer.slots):
    emb = found[k]
    tables.update(_split(k, emb, emb.logical_table()))
    per_slot = {name: _split(k, emb, _logical_rows(v[...], emb)) for name, v in slots.items()}
    for part, _, _ in _parts(k, emb):
      slot_tree[part] = {name: split[part] for name, split in per_slot.items()}
  tree = {
      "dense": nnx.to_pure_dict(dense),
      "tables": tables,
      "slots": slot_tree,
      "step": optimizer.step[...],
  }
  if optimizer.dense is not None:
    tree["dense_opt"] = nnx.to_pure_dict(nnx.state(optimizer.dense))
  return tree


def load_logical_state(model: nnx.Module, optimizer, tree: dict) -> None:
  """Loads ``logical_state`` output into a model built for any mesh.

  Args:
    model: a freshly built model (same config, any mesh).
    optimizer: its ``SparseAwareOptimizer``.
    tree: what ``logical_state`` returned (possibly on another mesh).
  """
  found = dict(row_grads.sparse_tables(model, optimizer.tables))
  keys = optimizer.keys
  wanted = [part for k in keys for part, _, _ in _parts(k, found[k])]
  missing = sorted(set(wanted) - set(tree["tables"]))
  if missing:
    raise ValueError(
        f"checkpoint has no tables {missing}; it was saved from a different "
        "model config (compare config.model and config.data with the run's)."
    )
  dense = nnx.state(model, row_grads.NotTables(frozenset(keys)))
  nnx.replace_by_pure_dict(dense, tree["dense"])
  nnx.update(model, dense)
  for key, slots in zip(keys, optimizer.slots):
    emb = found[key]
    emb.load_table(_joined(key, emb, tree["tables"]))
    for name, slot in optimizer.rule.slots().items():
      value = _joined(key, emb, {k: jnp.asarray(tree["slots"][k][name], slot.dtype)
                                 for k, _, _ in _parts(key, emb)})
      spec = apply_lib.slot_spec(slot, emb.plan)
      if emb.plan.placement is not None:
        value = rowmap.to_physical(value, emb.plan)
        slots[name][...] = sharding_lib.place_always(value, NamedSharding(emb.mesh, P(*spec)))
        continue
      slots[name][...] = _pad_and_place(
          value, apply_lib.slot_shape(slot, emb.plan), spec, emb.mesh)
  optimizer.step[...] = jnp.asarray(tree["step"], optimizer.step[...].dtype)
  if optimizer.dense is not None:
    state = nnx.state(optimizer.dense)
    nnx.replace_by_pure_dict(state, tree["dense_opt"])
    nnx.update(optimizer.dense, state)


def abstract_like(tree, mesh=None):
  """``ShapeDtypeStruct`` targets for restoring ``tree`` onto ``mesh``.

  Every leaf is restored replicated on the new mesh (or on one device);
  ``load_logical_state`` then lays tables and slots out as the new plans say.
  """
  if mesh is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  else:
    sharding = NamedSharding(mesh, P())
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
