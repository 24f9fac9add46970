"""The training loop's keys of a config, read and checked in one place.

``num_train_steps``, ``batch_size``, ``seed`` and the cadences were read
wherever they were needed (the model's seed in setup, the schedules' length
there too, the loop's cadences in ``train_lib``, the data's batch in the
task's sources), so a key's checks and defaults lived apart from most of its
uses. ``Loop.from_config`` is the one reader: everything after takes the
``Loop``.
"""

from __future__ import annotations

import dataclasses

import jax

from embedlib.training.tasks.base import fail as _fail

_AT_LEAST_ONE = ("batch_size", "num_train_steps", "log_every", "eval_every", "eval_batches",
                 "checkpoint_every")
#: Keys a config may leave at 0 for the data to set: ``config.data.num_epochs``
#: passes, an eval and a checkpoint each (``resolve_epochs``).
FROM_EPOCHS = ("num_train_steps", "eval_every", "checkpoint_every")


def _epochs(config) -> int:
  data = config.get("data")
  return int(data.get("num_epochs", 0) or 0) if data is not None else 0


def resolve_epochs(config, steps_per_epoch: int | None) -> None:
  """Sets the ``FROM_EPOCHS`` keys left at 0 from ``config.data.num_epochs`` (in place).

  Run once the task has read its data (``Task.steps_per_epoch``); the
  config saved in the workdir then holds the steps the run takes.
  """
  epochs = _epochs(config)
  if not epochs or not steps_per_epoch:
    return
  if config.num_train_steps == 0:
    config.num_train_steps = epochs * steps_per_epoch
  for key in ("eval_every", "checkpoint_every"):
    if config[key] == 0:
      config[key] = steps_per_epoch


@dataclasses.dataclass(frozen=True)
class Loop:
  """What the loop does at each step, and with how many examples.

  Attributes:
    num_train_steps: the last step.
    batch_size: examples per step, over every process.
    seed: the model's initialisation and the data's order.
    eval_batches: batches per evaluation.
    log_every, eval_every, checkpoint_every: cadences, in steps; the last
      step logs, evaluates and saves whatever they are.
    max_checkpoints: how many checkpoints the workdir keeps.
    prefetch: batches read ahead on the host (``config.data.prefetch``).
    pipeline: the pipelined step (ids distributed a step ahead).
    early_fetch: the share of a route's slots the pipelined step fetches ahead.
  """

  num_train_steps: int
  batch_size: int
  seed: int
  eval_batches: int
  log_every: int
  eval_every: int
  checkpoint_every: int
  max_checkpoints: int
  prefetch: int
  pipeline: bool = False
  early_fetch: float = 0.0

  @classmethod
  def from_config(cls, config, *, unresolved: bool = False) -> "Loop":
    """The loop of ``config`` (``configs/*.py``); ``pipeline`` and ``early_fetch`` may be absent.

    Args:
      config: the run's config.
      unresolved: accept the ``FROM_EPOCHS`` keys at 0 with
        ``config.data.num_epochs`` set (before the data is read; the loop
        returned is then only a check).

    Raises:
      ConfigError: naming the first key that can't work, and the fix.
    """
    for key in _AT_LEAST_ONE:
      if config[key] < 1:
        if key in FROM_EPOCHS and config[key] == 0 and _epochs(config):
          if unresolved:
            continue
          _fail(key, "is 0, to be set from config.data.num_epochs once the data is read "
                "(loop.resolve_epochs); give a number of steps or resolve it first.")
        _fail(key, f"must be >= 1, got {config[key]}.")
    if config.get("early_stopping", 0) < 0:
      _fail("early_stopping", f"must be >= 0 (evals without improvement; 0: off), got "
            f"{config.early_stopping}.")
    early_fetch, pipelined = config.get("early_fetch", 0.0), config.get("pipeline", False)
    if not 0.0 <= early_fetch <= 1.0:
      _fail("early_fetch", f"{early_fetch} is not a share of a route's slots in [0, 1].")
    if early_fetch and not pipelined:
      _fail("early_fetch", "fetches the next batch's rows in the pipelined step; set "
            "pipeline=True with it, or early_fetch=0.")
    if config.batch_size % jax.process_count():
      _fail("batch_size", f"{config.batch_size} must divide over "
            f"{jax.process_count()} processes.")
    return cls(
        num_train_steps=config.num_train_steps, batch_size=config.batch_size, seed=config.seed,
        eval_batches=config.eval_batches, log_every=config.log_every,
        eval_every=config.eval_every, checkpoint_every=config.checkpoint_every,
        max_checkpoints=config.max_checkpoints, prefetch=config.data.prefetch,
        pipeline=bool(pipelined), early_fetch=float(early_fetch))

  def logs(self, step: int) -> bool:
    """Whether ``step`` writes the train scalars.

    >>> loop = Loop(10, 8, 0, 1, log_every=4, eval_every=5, checkpoint_every=5,
    ...             max_checkpoints=2, prefetch=2)
    >>> [s for s in range(1, 11) if loop.logs(s)]
    [4, 8, 10]
    """
    return step % self.log_every == 0 or step == self.num_train_steps

  def evaluates(self, step: int) -> bool:
    """Whether ``step`` runs an evaluation."""
    return step % self.eval_every == 0 or step == self.num_train_steps

  def saves(self, step: int) -> bool:
    """Whether ``step`` writes a checkpoint."""
    return step % self.checkpoint_every == 0 or step == self.num_train_steps
