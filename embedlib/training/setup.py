"""Turning a config into the pieces of a run: mesh, data, model, optimizer.

Every check of the config happens here or in its task (``tasks``), before
anything is written to the workdir, so a bad config or a missing data file
leaves no half-made run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import checkpoint
from embedlib import dynamic
from embedlib import host_memory
from embedlib import optim
from embedlib.collection import FeatureSpec, TableSpec, budget, fit_id_skews
from embedlib.data.spec import DataSpec
from embedlib.plan import memory as plan_memory
from embedlib.plan.report import human_bytes
from embedlib.training import early_stop
from embedlib.training import loop as loop_lib
from embedlib.training import tasks
from embedlib.training.loop import Loop
from embedlib.training.tasks.base import ConfigError, fail as _fail

DENSE_OPTIMIZERS = {"adam": optax.adam, "adagrad": optax.adagrad, "sgd": optax.sgd}
SPARSE_OPTIMIZERS = {
    "rowwise_adagrad": optim.RowWiseAdagrad,
    "lazy_adam": optim.LazyAdam,
    "sgd": optim.SparseSGD,
}


class WorkdirError(RuntimeError):
  """The workdir can't be written; the message names the path and the fix."""


def check_workdir(workdir: str) -> None:
  """Writes a file in ``workdir`` (or a directory where it would be created) and removes it.

  A read-only workdir fails before the model is built; a workdir that
  doesn't exist yet is not created here, so a config error found later,
  while the model is built, still leaves nothing behind.

  Raises:
    WorkdirError: naming the path, why it can't be written, and the fix.
  """
  path = os.path.abspath(workdir)
  above = path
  while not os.path.exists(above):
    above = os.path.dirname(above)
  if not os.path.isdir(above):
    where = "is a file" if above == path else f"is under {above}, which is a file"
    raise WorkdirError(f"the workdir {path} {where}, not a directory; pass a --workdir "
                       "that is a directory or does not exist yet.")
  try:
    if above == path:
      with tempfile.TemporaryFile(dir=path):
        pass
    else:  # the first directory the run would create
      os.rmdir(tempfile.mkdtemp(dir=above))
  except OSError as e:
    reason = e.strerror or type(e).__name__
    raise WorkdirError(f"the workdir {path} can't be written ({reason}); pass a --workdir "
                       "you can write to, or make this one writable.") from None


def task(config) -> tasks.Task:
  """The run's task, built once from a checked config; everything after takes it.

  Checks the loop's keys (``Loop.from_config``) and the optimizers' names,
  then builds the task ``config.task.name`` names (``ctr`` when the config
  has no ``task``), which reads and checks ``config.task`` and
  ``config.data``, and checks that its data is there (``Task.check_data``;
  ``tasks.make_task`` builds a task, for a model alone, without it).

  Raises:
    ConfigError: naming the first key that can't work, and the fix.
  """
  Loop.from_config(config, unresolved=True)
  if config.optim.dense.name not in DENSE_OPTIMIZERS:
    _fail("optim.dense.name", f"{config.optim.dense.name!r}; use one of "
          f"{tuple(DENSE_OPTIMIZERS)}.")
  if config.optim.sparse.name not in SPARSE_OPTIMIZERS:
    _fail("optim.sparse.name", f"{config.optim.sparse.name!r}; use one of "
          f"{tuple(SPARSE_OPTIMIZERS)}.")
  made = tasks.make_task(config)
  made.check_data()
  return made


def resolve_epochs(config, task_) -> None:
  """Sets the steps a ``config.data.num_epochs`` run takes, once ``task_`` has read its data."""
  if any(config[k] == 0 for k in loop_lib.FROM_EPOCHS):
    loop_lib.resolve_epochs(config, task_.steps_per_epoch(config.batch_size))


def validate(config) -> None:
  """Raises ``ConfigError`` naming the first key of ``config`` that can't work (``task``)."""
  task(config)


def make_mesh(config):
  """The run's mesh; ``-1`` in ``mesh_shape`` takes the remaining devices.

  Auto axis types: dense layers are data-parallel and the compiler places
  their gradients' reductions; embedding tables lay themselves out.
  """
  shape = list(config.mesh_shape)
  if shape.count(-1) > 1:
    _fail("mesh_shape", f"{tuple(shape)} has more than one -1.")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    shape[shape.index(-1)] = jax.device_count() // known
  if int(np.prod(shape)) != jax.device_count():
    _fail("mesh_shape", f"{tuple(config.mesh_shape)} needs {int(np.prod(shape))} devices, "
          f"this run has {jax.device_count()}; use -1 for 'the rest'.")
  axes = tuple(config.mesh_axes)
  return jax.make_mesh(tuple(shape), axes, axis_types=(AxisType.Auto,) * len(axes))


def _schedule(cfg, num_steps):
  if cfg.schedule == "constant":
    return optax.constant_schedule(cfg.learning_rate)
  if cfg.schedule == "warmup_cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(cfg.warmup_steps, 1), max(num_steps, cfg.warmup_steps + 1))
  raise ConfigError(f"schedule {cfg.schedule!r}; use 'constant' or 'warmup_cosine'.")


def _on_mesh(module, mesh) -> None:
  """Places the arrays of ``module`` that aren't on ``mesh`` there, replicated.

  Dense parameters and optax state are created uncommitted on one device; a
  jitted step returns them replicated on the mesh, so without this the
  second step's inputs differ from the first's and ``train_step`` compiles
  twice.
  """
  replicated = NamedSharding(mesh, P())
  state = nnx.state(module)
  unplaced = lambda x: not (isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
                            and x.sharding.mesh == mesh)
  moved = jax.jit(lambda t: t, out_shardings=replicated)(
      jax.tree.map(lambda x: x if unplaced(x) else None, state))
  nnx.update(module, jax.tree.map(lambda new, old: old if new is None else new, moved, state,
                                  is_leaf=lambda x: x is None))


#: The tables' ``id_skew`` a run fitted (``config.model.id_skew = "fit"``), in its workdir.
ID_SKEW_FILE = "id_skew.json"


def fitted_id_skews(config, task_, spec, train_source, mesh, workdir: str):
  """The tables' skews ``config.model.id_skew = "fit"`` asks for; None for any other setting.

  A workdir holding ``ID_SKEW_FILE`` (a run started there before) gives its
  skews back, so a resumed run plans as it did. Otherwise they are fitted
  to the first training batch (``embedlib.collection.fit_id_skews``; the
  source is left where it was), each process its own slice, the smallest
  over the processes kept, so every process plans the same program.
  ``save_id_skews`` writes them once the workdir exists.
  """
  if config.model.get("id_skew") != "fit":
    return None
  saved = _saved_id_skews(workdir)
  if saved is not None:
    return saved
  if not isinstance(spec, DataSpec) or getattr(task_, "raw_ids", False):
    raise ConfigError(
        "config.model.id_skew='fit' fits the fixed tables of a click model (the ctr task "
        "without data.raw_ids); leave it None here.")
  state = train_source.get_state()
  sparse = next(train_source)["sparse"]
  train_source.set_state(state)
  tables = [TableSpec(f.name, f.num_embeddings, 1) for f in spec.features]
  features = [FeatureSpec(f.name, f.name) for f in spec.features]
  local = np.asarray(sparse[spec.features[0].name]).shape[0]
  shards = max(1, min(local, mesh.size // jax.process_count()))
  skews = fit_id_skews(tables, features, sparse, data_shards=shards)
  names = sorted(skews)
  values = np.asarray([skews[n] for n in names], np.float32)
  if jax.process_count() > 1:
    values = multihost_utils.process_allgather(values).reshape(-1, len(names)).min(axis=0)
  return {n: round(float(v), 3) for n, v in zip(names, values)}


def _saved_id_skews(workdir: str):
  """The skews a run fitted in ``workdir`` (``ID_SKEW_FILE``), or None if it has none."""
  path = os.path.join(workdir, ID_SKEW_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return {k: float(v) for k, v in json.load(f).items()}


def save_id_skews(workdir: str, skews) -> None:
  """Writes ``fitted_id_skews``' result into the workdir (process 0), if there is one."""
  if skews is None or jax.process_index() != 0:
    return
  path = os.path.join(workdir, ID_SKEW_FILE)
  if not os.path.exists(path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(skews, f, indent=2, sort_keys=True)
    os.replace(tmp, path)  # a process killed here leaves no half-written file


def _model(config, task_, spec, mesh, id_skews=None):
  """``task_``'s model of ``config`` on ``mesh`` (its dense arrays not yet placed: ``_on_mesh``).

  ``id_skews``: the tables' fitted skews (``fitted_id_skews``), in place of
  ``config.model.id_skew``'s ``"fit"``.
  """
  loop = Loop.from_config(config)
  model_config = config.model
  if id_skews is not None:
    model_config = config.model.copy_and_resolve_references()
    with model_config.ignore_type():  # "fit" (a str) becomes {table: skew}
      model_config.id_skew = dict(id_skews)
  try:
    model = task_.build_model(model_config, spec, mesh, batch_size=loop.batch_size,
                              rngs=nnx.Rngs(loop.seed))
  except ValueError as e:  # the factory names the config key and the fix
    raise ConfigError(str(e)) from None
  return model


def model_and_optimizer(config, task_, spec, mesh, id_skews=None):
  """The model of ``task_`` and its ``SparseAwareOptimizer``, every array on ``mesh``.

  The tables train row-wise with ``config.optim.sparse``, or with the dense
  optimizer where the task says so (``Task.sparse_tables``). ``id_skews``:
  ``fitted_id_skews``' result, where the config asks to fit them.
  """
  loop = Loop.from_config(config)
  model = _model(config, task_, spec, mesh, id_skews)
  optim_config = config.optim
  tx = DENSE_OPTIMIZERS[optim_config.dense.name](
      _schedule(optim_config.dense, loop.num_train_steps))
  rule = None  # a task whose table is an output layer trains it with the dense optimizer
  if task_.sparse_tables:
    rule = SPARSE_OPTIMIZERS[optim_config.sparse.name](
        learning_rate=_schedule(optim_config.sparse, loop.num_train_steps))
  optimizer = optim.SparseAwareOptimizer(model, tx, rule)
  _on_mesh(model, mesh)
  _on_mesh(optimizer, mesh)
  host_memory.release_freed()  # the initialisers' temporaries
  return model, optimizer


def planned_memory(model, optimizer) -> plan_memory.DeviceMemory:
  """The plan's memory of the model's embedding step per device (``embedlib.plan.memory``).

  Every table and stack once: a collection's tables apart and stacks, with
  the ids and rows its features look up at its planned batch
  (``collection.budget.step_memory``), its dynamic tables with their maps,
  and the sparse ``ShardedEmbed`` s and ``DynamicEmbed`` s outside a
  collection, with the slots of ``optimizer``'s row-wise rule (a
  ``SparseAwareOptimizer``; none without one).
  """
  collections, seen = [], set()
  for _, module in nnx.iter_graph(model):
    table_plans = getattr(getattr(module, "plan", None), "tables", None)
    if table_plans is None:  # not a collection
      continue
    step = budget.step_memory(
        [(t.plan, t.num_unique) for t in table_plans if t.stack is None], module.plan.stacks,
        module.feature_specs, batch_size=module.plan.batch_size, optimizer=optimizer.rule)
    collections += step.tables
    for name, table in getattr(module, "dynamic", {}).items():
      local = -(-module.plan.batch_size // table.rows.plan.data_shards)
      ids, rows = budget.lookups(module.feature_specs, [name], local)
      collections.append(_dynamic_memory(table, optimizer, ids, rows))
    seen.update(id(m) for _, m in optim.sparse_tables(module))
  for _, module in nnx.iter_graph(model):
    if isinstance(module, dynamic.DynamicEmbed) and id(module.rows) not in seen:
      collections.append(_dynamic_memory(module, optimizer))
      seen.add(id(module.rows))
  alone = plan_memory.device_memory(
      [m.plan for _, m in optim.sparse_tables(model) if id(m) not in seen], optimizer.rule)
  return plan_memory.DeviceMemory(tuple(collections) + alone.tables, alone.optimizer)


def _dynamic_memory(table, optimizer, ids=None, rows=None) -> plan_memory.TableMemory:
  """A ``DynamicEmbed``'s step on a device: its rows' (``table_memory``) and its map."""
  memory = plan_memory.table_memory(table.rows.plan, ids, rows=rows, optimizer=optimizer.rule)
  default = 0 if table.default_row is None else table.features * table.rows.plan.itemsize
  return dataclasses.replace(memory, name=table.name, table=memory.table + default,
                             map=table.map_bytes_per_device())


def describe_step_memory(step, model, optimizer, *args, **kwargs) -> str:
  """The compiled train step's memory per device, beside the plan's of its embedding.

  ``step(model, optimizer, *args, **kwargs)`` is the jitted train step
  (``steps.train_step``) and the arguments its first call's: the
  executable ``step.lower(...).compile()`` returns is the one that call
  runs (jax caches it), so printing this at start compiles nothing twice.
  """
  stats = step.lower(model, optimizer, *args, **kwargs).compile().memory_analysis()
  plan = planned_memory(model, optimizer)
  maps = f", map {human_bytes(plan.map)}" if plan.map else ""
  planned = (f"the plan's embedding: {human_bytes(plan.total)} (tables "
             f"{human_bytes(plan.table)}, slots {human_bytes(plan.slots)}{maps}, ids "
             f"{human_bytes(plan.ids)}, temporaries {human_bytes(plan.temporary)})")
  if stats is None:  # a backend without a memory analysis
    return f"train step memory per device: not reported by this backend; {planned}"
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
  return (f"train step memory per device, compiled: {human_bytes(total)} (arguments "
          f"{human_bytes(stats.argument_size_in_bytes)}, temporaries "
          f"{human_bytes(stats.temp_size_in_bytes)}); {planned}; the dense weights, their "
          f"optimizer state and the batch are the rest")


def sources(config, task_, spec):
  """``task_``'s (train, eval) sources of ``config``'s batches, each this process's slice.

  Raises:
    ConfigError: the data can't give a batch (e.g. a Criteo file without one).
  """
  loop = Loop.from_config(config)
  return task_.sources(spec, batch_size=loop.batch_size, seed=loop.seed,
                       eval_batches=loop.eval_batches)


def describe_eval(config, task_) -> str:
  """Which examples the run evaluates on, for the log."""
  loop = Loop.from_config(config)
  return task_.describe_eval(batch_size=loop.batch_size, eval_batches=loop.eval_batches)


def restore_model(config, workdir: str, mesh=None):
  """A ``train_and_evaluate`` run's model: ``(model, mesh)``.

  Its weights are those the run scored its test rows with: its best eval's,
  where early stopping kept them (``early_stop.BEST_DIR``), else its last
  checkpoint's. ``config`` is the run's; ``mesh`` defaults to
  ``make_mesh(config)`` and may hold another device count than the run
  trained on (the checkpoint is logical). Only the model is built and
  read: no optimizer state.
  """
  mesh = make_mesh(config) if mesh is None else mesh
  made = task(config).for_workdir(workdir)
  resolve_epochs(config, made)
  skews = None
  if config.model.get("id_skew") == "fit":
    skews = _saved_id_skews(workdir)
    if skews is None:
      raise ConfigError(
          f"config.model.id_skew='fit', but {os.path.join(workdir, ID_SKEW_FILE)} is missing: "
          "the run's fitted skews. Restore from the workdir of that run.")
  model = _model(config, made, made.data_spec(), mesh, skews)
  _on_mesh(model, mesh)
  # The tables a row-wise rule trained are stored apart (model_and_optimizer's rule).
  keys = tuple(k for k, _ in optim.sparse_tables(model)) if made.sparse_tables else ()
  best = early_stop.has_best(workdir)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, early_stop.BEST_DIR if best else
                                              "checkpoints"))
  try:
    ckpt.restore_model(model, keys)
  finally:
    ckpt.close()
  return model, mesh
