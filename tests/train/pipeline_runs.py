"""What the pipelined-step tests share: a model placed as the train loop places it,
and a pipelined run checkpointed halfway and resumed on a fresh model."""

import jax
import numpy as np
import pytest
from flax import nnx

from embedlib import checkpoint, optim
from embedlib.training import pipeline, setup


class Numbered:
  """Batches ``make_batch(1) .. make_batch(steps)`` with a resumable position."""

  def __init__(self, steps, make_batch):
    self.position, self.steps, self.make_batch = 0, steps, make_batch

  def __iter__(self):
    return self

  def __next__(self):
    if self.position >= self.steps:
      raise StopIteration
    self.position += 1
    return self.make_batch(self.position)

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = state["position"]


def placed(model, tx, rule, mesh):
  """``model`` and its sparse-aware optimizer on ``mesh``, as the train loop places them.

  One compile per step function, and a restore lands alike.
  """
  optimizer = optim.SparseAwareOptimizer(model, tx, rule)
  setup._on_mesh(model, mesh)  # pylint: disable=protected-access
  setup._on_mesh(optimizer, mesh)  # pylint: disable=protected-access
  return model, optimizer


def resumed_halfway(make, source, task, num_steps, tmp_path, *, early_fetch=0.0,
                    check_restored=None):
  """``num_steps`` pipelined steps, checkpointed after half and resumed on ``make()``'s model.

  Args:
    make: builds a fresh ``(model, optimizer)``.
    source: ``source(num_steps)`` is a resumable batch source.
    task: the run's task.
    num_steps: steps in all.
    tmp_path: where the checkpoint goes.
    early_fetch: the pipeline's early fetch share.
    check_restored: called with the restored ``model`` before it resumes.

  Returns:
    ``(losses, model, optimizer)`` after the last step; the source is spent.
  """
  half = num_steps // 2
  model, optimizer = make()
  runner = pipeline.Pipeline(model, optimizer, source(num_steps), task, early_fetch=early_fetch)
  losses = [float(runner.step()) for _ in range(half)]
  ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"))
  try:
    ckpt.save(half, model, optimizer, runner.get_state())
    ckpt.wait()
    model, optimizer = make()
    step, data_state = ckpt.restore_newest(model, optimizer)
  finally:
    ckpt.close()
  assert step == half and data_state == {"position": half}
  if check_restored is not None:
    check_restored(model)
  resumed = source(num_steps)
  resumed.set_state(data_state)
  runner = pipeline.Pipeline(model, optimizer, resumed, task, early_fetch=early_fetch)
  losses += [float(runner.step()) for _ in range(num_steps - half)]
  with pytest.raises(StopIteration):
    runner.step()
  return losses, model, optimizer


def leaves(model, optimizer):
  """Every variable of both, as numpy: rows, slots, and a dynamic table's map and clocks."""
  return [np.asarray(x) for x in jax.tree.leaves((nnx.state(model), nnx.state(optimizer)))]
