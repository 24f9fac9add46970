"""Turning a config into the pieces of a run: mesh, data, model, optimizer.

Every check of the config happens here, before anything is written to the
workdir, so a bad config or a missing data file leaves no half-made run.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import data as data_lib
from embedlib import optim
from embedlib.models import build_model

SOURCES = ("synthetic", "criteo")
DENSE_OPTIMIZERS = {"adam": optax.adam, "adagrad": optax.adagrad, "sgd": optax.sgd}
SPARSE_OPTIMIZERS = {
    "rowwise_adagrad": optim.RowWiseAdagrad,
    "lazy_adam": optim.LazyAdam,
    "sgd": optim.SparseSGD,
}


class ConfigError(ValueError):
  """A config value the run can't use; the message names the key and the fix."""


def _fail(key: str, message: str):
  raise ConfigError(f"config.{key}: {message}")


def validate(config) -> None:
  """Checks values that ConfigDict's types can't; raises naming the key."""
  for key in ("batch_size", "num_train_steps", "log_every", "eval_every",
              "eval_batches", "checkpoint_every"):
    if config[key] < 1:
      _fail(key, f"must be >= 1, got {config[key]}.")
  if config.data.source not in SOURCES:
    _fail("data.source", f"{config.data.source!r}; use one of {SOURCES}.")
  data = config.data
  if data.max_bad_lines < -1:
    _fail("data.max_bad_lines", f"must be >= 0, or -1 to skip every malformed line; got "
          f"{data.max_bad_lines}.")
  if not 0.0 <= data.eval_holdout < 1.0:
    _fail("data.eval_holdout", f"must be a fraction in [0, 1); got {data.eval_holdout}.")
  if data.source == "criteo":
    if bool(data.eval_path) == bool(data.eval_holdout):
      _fail("data.eval_path", "the criteo source evaluates on a file of its own "
            "(data.eval_path) or on a held-out fraction of the training lines "
            "(data.eval_holdout, e.g. 0.05): set exactly one, "
            f"got eval_path={data.eval_path!r} and eval_holdout={data.eval_holdout}.")
    for key in ("train_path", "eval_path"):
      path = data[key]
      if key == "train_path" and not path:
        _fail(f"data.{key}", "the criteo source needs a path to a Criteo TSV file.")
      if path and not os.path.isfile(path):
        _fail(f"data.{key}", f"{path!r} does not exist; pass an existing .tsv or "
              ".tsv.gz file in the Criteo layout.")
  elif data.eval_holdout:
    _fail("data.eval_holdout", f"the {data.source} source has its own eval stream; "
          "leave eval_holdout at 0.")
  if config.optim.dense.name not in DENSE_OPTIMIZERS:
    _fail("optim.dense.name", f"{config.optim.dense.name!r}; use one of "
          f"{tuple(DENSE_OPTIMIZERS)}.")
  if config.optim.sparse.name not in SPARSE_OPTIMIZERS:
    _fail("optim.sparse.name", f"{config.optim.sparse.name!r}; use one of "
          f"{tuple(SPARSE_OPTIMIZERS)}.")
  if config.batch_size % jax.process_count():
    _fail("batch_size", f"{config.batch_size} must divide over "
          f"{jax.process_count()} processes.")


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


def data_spec(config) -> data_lib.DataSpec:
  try:
    if config.data.source == "criteo":
      return data_lib.criteo_spec(list(config.data.table_sizes) or 100_000)
    return data_lib.DataSpec.from_sizes(
        config.data.num_dense, list(config.data.table_sizes),
        bag_sizes=list(config.data.bag_sizes) or None)
  except ValueError as e:
    raise ConfigError(f"config.data.table_sizes / bag_sizes: {e}") from None


def describe_eval(config) -> str:
  """Which examples the run evaluates on, for the log."""
  data = config.data
  if data.source != "criteo":
    return (f"the {data.source} source's eval stream ({config.eval_batches} batches, drawn "
            "apart from the training stream)")
  if data.eval_holdout:
    return (f"a held-out {data.eval_holdout:.1%} of the lines of {data.train_path} (chosen by "
            f"a hash of the line number; training skips them), at most {config.eval_batches} "
            "batches")
  return f"{data.eval_path}, at most {config.eval_batches} batches"


def _first_batch_or_fail(source, key: str, what: str, batch_size: int) -> None:
  """Reads one batch and rewinds, so a file without a batch fails before training."""
  state = source.get_state()
  try:
    next(source)
  except StopIteration:
    raise ConfigError(
        f"config.{key}: {what} holds fewer than batch_size={batch_size} valid lines, not "
        "one batch. Pass more data or a smaller --config.batch_size.") from None
  source.set_state(state)


def sources(config, spec):
  """(train source, eval source), each this process's slice.

  Raises:
    ConfigError: a Criteo file (or the hold-out) holds no full batch.
  """
  share = dict(process_index=jax.process_index(), process_count=jax.process_count())
  data = config.data
  if data.source == "criteo":
    kw = dict(batch_size=config.batch_size, **share,
              max_bad_lines=None if data.max_bad_lines == -1 else data.max_bad_lines)
    train = data_lib.CriteoReader(data.train_path, spec, num_epochs=None,
                                  holdout=data.eval_holdout, split="train", **kw)
    if data.eval_holdout:
      evaluation = data_lib.CriteoReader(data.train_path, spec, num_epochs=1,
                                         holdout=data.eval_holdout, split="holdout", **kw)
      eval_key, eval_what = "data.eval_holdout", f"the hold-out of {data.train_path}"
    else:
      evaluation = data_lib.CriteoReader(data.eval_path, spec, num_epochs=1, **kw)
      eval_key, eval_what = "data.eval_path", data.eval_path
    _first_batch_or_fail(train, "data.train_path", data.train_path, config.batch_size)
    _first_batch_or_fail(evaluation, eval_key, eval_what, config.batch_size)
    return train, evaluation
  kw = dict(batch_size=config.batch_size, seed=config.seed,
            zipf_exponent=data.zipf_exponent,
            signal_scale=data.signal_scale, **share)
  train = data_lib.SyntheticSource(spec, split="train", **kw)
  evaluation = data_lib.SyntheticSource(spec, split="eval", num_batches=config.eval_batches, **kw)
  return train, evaluation


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


def model_and_optimizer(config, spec, mesh):
  """The model and its ``SparseAwareOptimizer``, every array on ``mesh``."""
  model = build_model(config.model, spec, mesh=mesh, batch_size=config.batch_size,
                      rngs=nnx.Rngs(config.seed))
  dense = config.optim.dense
  tx = DENSE_OPTIMIZERS[dense.name](_schedule(dense, config.num_train_steps))
  sparse = config.optim.sparse
  rule = SPARSE_OPTIMIZERS[sparse.name](
      learning_rate=_schedule(sparse, config.num_train_steps))
  optimizer = optim.SparseAwareOptimizer(model, tx, rule)
  _on_mesh(model, mesh)
  _on_mesh(optimizer, mesh)
  return model, optimizer
