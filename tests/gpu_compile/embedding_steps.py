"""A config's embedding alone: its lookups and sparse step, as abstract arrays on GPU devices.

What the plan's memory (``EmbeddingPlan.memory``) states is the embedding's
own: its tables, its sparse optimizer's slots and its lookups' and update's
temporaries. The program it is checked against holds the same and nothing
else: the model is built as ``train`` builds it (``train_steps``), its
embedding modules taken out (an ``EmbeddingCollection`` and the sparse
``ShardedEmbed`` s outside one), given their own ``SparseAwareOptimizer``
with the config's row-wise rule, looked up on the config's batch (a
collection's features) or on ``ids_per_device`` ids a device (a table
alone), and updated from the gradient of the rows' sum of squares.
"""

from __future__ import annotations

import math
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import EmbeddingCollection, optim
from embedlib import embed as embed_lib
from embedlib.training import setup, tasks
from tests.gpu_compile import compiled, train_steps


def embedding_parts(model) -> tuple[list, list]:
  """``(collections, tables)``: the model's collections and its sparse tables outside them."""
  collections, inside = [], set()
  for _, module in nnx.iter_graph(model):
    if isinstance(module, EmbeddingCollection):
      collections.append(module)
      inside.update(id(m) for _, m in optim.sparse_tables(module))
  tables = [m for _, m in optim.sparse_tables(model) if id(m) not in inside]
  return collections, tables


def sparse_rule(config):
  """The config's row-wise rule, as ``setup.model_and_optimizer`` makes it."""
  return setup.SPARSE_OPTIMIZERS[config.optim.sparse.name](
      learning_rate=config.optim.sparse.learning_rate)


def embedding_step(config, mesh):
  """``(step, abstract state, abstract inputs, plans)`` of the config's embedding alone.

  ``plans``: ``(plan, ids, num_unique, rows)`` of every table and stack the
  step holds, once each: its ``EmbeddingPlan``, the ids a device looks up
  in it a step, its dedup capacity and the rows the lookup returns a
  device (``embedlib.plan.memory.device_memory``'s items). ``step(state, inputs) -> (loss, state)``.
  """
  task = tasks.make_task(config)
  spec = task.data_spec()

  def build():
    with mock.patch.object(setup, "_on_mesh", lambda module, mesh: None):
      model, _ = setup.model_and_optimizer(config, task, spec, mesh)
    collections, tables = embedding_parts(model)
    parts = nnx.List(collections + tables)
    return parts, optim.SparseAwareOptimizer(parts, None, sparse_rule(config))

  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    pair = nnx.eval_shape(build)
  parts, _ = pair
  graphdef, state = nnx.split(pair)
  state = tables_placed(pair, compiled.abstract(state, mesh), mesh)
  data = NamedSharding(mesh, P(tuple(config.mesh_axes)))
  batch = train_steps.host_batch(config, task, spec)
  inputs, plans = [], []
  for part in parts:
    if isinstance(part, EmbeddingCollection):
      names = [f.name for f in part.feature_specs]
      inputs.append({n: jax.ShapeDtypeStruct(batch["sparse"][n].shape, jnp.int32, sharding=data)
                     for n in names})
      shards = part.plan.tables[0].plan.data_shards if part.plan.tables else 1
      shape = {f.name: batch["sparse"][f.name].shape for f in part.feature_specs}
      ids = {f: math.prod(s) // shards for f, s in shape.items()}
      # A pooled feature returns a row a sample, a sequence one an id.
      rows = {f.name: (shape[f.name][0] if f.combiner else math.prod(shape[f.name])) // shards
              for f in part.feature_specs}
      for t in part.plan.tables:
        if t.stack is None:
          plans.append((t.plan, sum(ids[f] for f in t.features), t.num_unique,
                        sum(rows[f] for f in t.features)))
      for s in part.plan.stacks:
        members = [f for t in part.plan.tables if t.stack == s.name for f in t.features]
        plans.append((s.plan, sum(ids[f] for f in members), s.num_unique,
                      sum(rows[f] for f in members)))
    else:
      p = part.plan
      inputs.append(jax.ShapeDtypeStruct((p.ids_per_device * p.data_shards,), jnp.int32,
                                         sharding=data))
      plans.append((p, p.ids_per_device, None, p.ids_per_device))

  def step(state, inputs):
    parts, opt = nnx.merge(graphdef, state)

    def loss(parts):
      total = 0.0
      for part, ids in zip(parts, inputs):
        rows = part(ids)
        for r in (rows.values() if isinstance(rows, dict) else [rows]):
          total = total + jnp.sum(r.astype(jnp.float32) ** 2)
      return total

    value, grads = optim.value_and_grad(loss)(parts)
    opt.update(parts, grads)
    return value, nnx.state((parts, opt))

  return step, state, inputs, plans


def _key(k) -> str:
  return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def tables_placed(pair, state, mesh):
  """``state`` with every table sharded as its plan lays it out.

  An abstract build leaves a padded table's value without a sharding
  (a concrete build shards it), which ``compiled.abstract`` would read as
  replicated: every device would hold each padded table whole.
  """
  placed = {}
  for path, module in nnx.iter_graph(pair):
    if isinstance(module, embed_lib.ShardedEmbed):
      placed[tuple(_key(k) for k in path) + ("embedding",)] = NamedSharding(
          mesh, P(*module.plan.table_spec))

  def one(path, leaf):
    keys = tuple(_key(k) for k in path)
    for prefix, sharding in placed.items():
      if keys[:len(prefix)] == prefix:
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return leaf

  return jax.tree_util.tree_map_with_path(one, state)
