"""What a task is: the batch layout, loss and metrics of one kind of training.

``train_and_evaluate`` knows nothing about labels or models: the config names
a task (``config.task.name``), and the task turns the config into data
sources and a model, says how a batch reaches the device, what the loss is,
and what an eval measures. The loop around it (steps, checkpoints, resume,
signals, metrics files, several processes) is the same for every task.

A task is a frozen dataclass built from the config once per run
(``from_config``, the one reader of ``config.task`` and ``config.data``) and
passed to everything after: it is hashable, so the jitted train and eval
steps take it as a static argument and compile once per task. Settings only
the host reads (paths, a loaded split) are left out of its equality.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import numpy as np

from embedlib.models import build_model


class ConfigError(ValueError):
  """A config value the run can't use; the message names the key and the fix."""


def fail(key: str, message: str) -> tp.NoReturn:
  raise ConfigError(f"config.{key}: {message}")


def check_positive(config, *keys: str) -> None:
  """Raises naming the first of ``keys`` (dotted, under ``config``) that is < 1."""
  for key in keys:
    value = config
    for part in key.split("."):
      value = value[part]
    if value < 1:
      fail(key, f"must be >= 1, got {value}.")


def check_weights(key: str, weights, count: int, what: str) -> tuple[float, ...]:
  """``weights`` as a tuple of ``count`` finite, non-negative floats, or ConfigError."""
  weights = tuple(float(w) for w in weights)
  if len(weights) != count:
    fail(key, f"has {len(weights)} entries for {count} {what}; give one weight per "
         f"{what[:-1]}, in the order of config.data.actions.")
  if not all(np.isfinite(w) and w >= 0 for w in weights) or not any(weights):
    fail(key, f"{weights} must be finite, >= 0 and not all 0.")
  return weights


@dataclasses.dataclass(frozen=True)
class Task:
  """The interface every task implements (``ctr``, ``ranking``, ``retrieval``).

  Host side (numpy, outside jit):

  - ``from_config(config)``: the task with its settings, read from
    ``config.task`` and ``config.data`` and checked (with ``config.model.name``
    against the models the task trains) before anything is built.
  - ``check_data()``: that the data the settings name is there (files
    exist), before anything is built; a model is built without it.
  - ``for_workdir(workdir)``: the task once its data is read with what the
    run's workdir holds (a saved schema: ``tabular``); ``save(workdir)``
    writes that into a new run's workdir; ``describe_data()``: what was
    read, for the log (or None); ``steps_per_epoch(batch_size)``: batches
    in a pass over the training data, where ``config.data.num_epochs``
    sets the run's length (or None).
  - ``early_stopping_metric()``: ``(name, higher_is_better)`` of the eval
    metric ``config.early_stopping`` watches, or None.
  - ``data_spec()``: the dataset layout the model is sized from.
  - ``sources(spec, batch_size=, seed=, eval_batches=)``: ``(train, eval)``
    sources, each this process's slice, each with ``get_state`` /
    ``set_state``.
  - ``describe_eval(batch_size=, eval_batches=)``: which examples the eval
    uses, for the log.
  - ``featurize(batch)``: a source's batch to the arrays the model reads
    (hashing raw ids, checking sizes); runs in the prefetch thread, raises
    ``ValueError`` naming the field and the fix.
  - ``build_model(model_config, spec, mesh, batch_size=, rngs=)``: through
    ``embedlib.models``' factory (the one reader of ``config.model``).
  - ``oracle(eval_source)``: the planted optimum's metrics on the eval set
    (``oracle_*`` keys, logged beside the model's), or ``{}``.
  - ``evaluate(model, batches, mesh, source)``: metrics over global eval
    batches (``source``: the eval source they come from).
  - ``log_scalars(model)``: scalars read off the model at each logging
    step, written beside the loss (``{}`` for none).
  - ``test(model, eval_source, mesh)``: metrics on a held-out test set,
    once, after the last step (``test_*`` keys, written with the last
    eval), or ``{}``.

  Traced (inside the jitted steps):

  - ``loss(model, batch)``: the scalar loss.
  - ``predict(model, batch)``: the eval step's outputs.
  """

  name: tp.ClassVar[str] = "task"
  #: Whether the model's tables train row-wise (``config.optim.sparse``); a
  #: task whose table is also the output layer (``attend``: a dense
  #: gradient) trains it with the dense optimizer instead.
  sparse_tables: tp.ClassVar[bool] = True

  @classmethod
  def from_config(cls, config) -> Task:
    """The task with ``config``'s settings; raises ``ConfigError`` naming a bad key."""
    raise NotImplementedError

  def check_data(self) -> None:
    pass

  def for_workdir(self, workdir: str) -> Task:
    del workdir
    return self

  def save(self, workdir: str) -> None:
    del workdir

  def describe_data(self) -> str | None:
    return None

  def steps_per_epoch(self, batch_size: int) -> int | None:
    del batch_size
    return None

  def early_stopping_metric(self) -> tuple[str, bool] | None:
    return None

  def data_spec(self):
    raise NotImplementedError

  def sources(self, spec, *, batch_size: int, seed: int, eval_batches: int):
    raise NotImplementedError

  def describe_eval(self, *, batch_size: int, eval_batches: int) -> str:
    raise NotImplementedError

  def featurize(self, batch: dict) -> dict:
    return batch

  def build_model(self, model_config, spec, mesh, *, batch_size: int, rngs):
    return build_model(model_config, spec, mesh=mesh, batch_size=batch_size, rngs=rngs)

  def oracle(self, eval_source) -> dict:
    del eval_source
    return {}

  def log_scalars(self, model) -> dict:
    del model
    return {}

  def test(self, model, eval_source, mesh) -> dict:
    del model, eval_source, mesh
    return {}

  def loss(self, model, batch):
    raise NotImplementedError

  def predict(self, model, batch):
    raise NotImplementedError

  def evaluate(self, model, batches, mesh, source) -> dict:
    raise NotImplementedError
