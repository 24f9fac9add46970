"""The jitted train and eval steps, one compile per task (a static argument)."""

from __future__ import annotations

import optax
from flax import nnx

from embedlib import optim


def loss_fn(model, batch):
  """Mean sigmoid cross-entropy of a click model's logits (the ``ctr`` task's loss)."""
  logits = model(batch["dense"], batch["sparse"])
  return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()


def _loss(task):
  return loss_fn if task is None else task.loss


@nnx.jit(donate_argnums=(0, 1), static_argnames=("task",))
def train_step(model, optimizer, batch, task=None):
  """One step of ``task`` (default: click-through): row gradients for the tables,
  dense gradients for the rest; returns the loss."""
  loss, grads = optim.value_and_grad(_loss(task), tables=optimizer.tables)(model, batch)
  optimizer.update(model, grads)
  return loss


# graph_updates=False: nnx.jit's default returns every variable of its module
# arguments as outputs, so an undonated step would write a fresh copy of every
# table on each call; this way only variables the step changes come back.
@nnx.jit(static_argnames=("task",), graph_updates=False)
def eval_step(model, batch, task=None):
  """``task.predict`` (default: a click model's logits ``[batch]``); changes nothing."""
  if task is None:
    return model(batch["dense"], batch["sparse"])
  return task.predict(model, batch)
