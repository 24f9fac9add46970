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
from jax.sharding import AxisType

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
  if config.data.source == "criteo":
    for key in ("train_path", "eval_path"):
      path = config.data[key]
      if not path:
        _fail(f"data.{key}", "the criteo source needs a path to a Criteo TSV file.")
      if not os.path.isfile(path):
        _fail(f"data.{key}", f"{path!r} does not exist; pass an existing .tsv or "
              ".tsv.gz file in the Criteo layout.")
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
  if config.data.source == "criteo":
    return data_lib.criteo_spec(list(config.data.table_sizes) or 100_000)
  return data_lib.DataSpec.from_sizes(
      config.data.num_dense, list(config.data.table_sizes),
      bag_sizes=list(config.data.bag_sizes) or None)


def sources(config, spec):
  """(train source, eval source), each this process's slice."""
  share = dict(process_index=jax.process_index(), process_count=jax.process_count())
  if config.data.source == "criteo":
    kw = dict(batch_size=config.batch_size, max_bad_lines=config.data.max_bad_lines, **share)
    train = data_lib.CriteoReader(config.data.train_path, spec, num_epochs=None, **kw)
    evaluation = data_lib.CriteoReader(config.data.eval_path, spec, num_epochs=1, **kw)
    return train, evaluation
  kw = dict(batch_size=config.batch_size, seed=config.seed,
            zipf_exponent=config.data.zipf_exponent,
            signal_scale=config.data.signal_scale, **share)
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


def model_and_optimizer(config, spec, mesh):
  model = build_model(config.model, spec, mesh=mesh, batch_size=config.batch_size,
                      rngs=nnx.Rngs(config.seed))
  dense = config.optim.dense
  tx = DENSE_OPTIMIZERS[dense.name](_schedule(dense, config.num_train_steps))
  sparse = config.optim.sparse
  rule = SPARSE_OPTIMIZERS[sparse.name](
      learning_rate=_schedule(sparse, config.num_train_steps))
  return model, optim.SparseAwareOptimizer(model, tx, rule)
