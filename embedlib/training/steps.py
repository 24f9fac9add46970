"""The jitted train and eval steps, one compile per task (a static argument)."""

from __future__ import annotations

import optax
from flax import nnx

from embedlib import dynamic, optim


def loss_fn(model, batch):
  """Mean sigmoid cross-entropy of a click model's logits (the ``ctr`` task's loss)."""
  logits = model(batch["dense"], batch["sparse"])
  return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()


@nnx.jit(donate_argnums=(0, 1), static_argnames=("task",))
def train_step(model, optimizer, batch, *, task):
  """One step of ``task``: row gradients for the tables, dense gradients for the rest.

  Args:
    model: the model; its tables and other parameters change in place.
    optimizer: its ``SparseAwareOptimizer``.
    batch: a global batch of ``task``'s layout (``task.featurize``).
    task: the ``Task`` whose ``loss`` is minimised (``tasks.CTRTask()`` for a
      click model called as ``model(dense, sparse)``).

  Returns:
    The loss, a float32 scalar.
  """
  loss, grads = optim.value_and_grad(task.loss, tables=optimizer.tables)(model, batch)
  # Rows a dynamic table placed in this step's lookups start with fresh slots.
  dynamic.reset_slots(optimizer, model)
  optimizer.update(model, grads)
  return loss


# graph_updates=False: nnx.jit's default returns every variable of its module
# arguments as outputs, so an undonated step would write a fresh copy of every
# table on each call; this way only variables the step changes come back.
@nnx.jit(static_argnames=("task",), graph_updates=False)
def eval_step(model, batch, *, task):
  """``task.predict`` (a click model's logits ``[batch]`` for ``CTRTask``); changes nothing.

  Args:
    model: the model.
    batch: a global batch of ``task``'s layout.
    task: the ``Task`` whose ``predict`` runs.
  """
  return task.predict(model, batch)
