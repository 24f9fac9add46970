"""``train_and_evaluate``: the training loop behind ``python -m train``.

Importable (notebooks and tests call it), independent of flags.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental import multihost_utils

from embedlib import checkpoint, metrics, optim
from embedlib import data as data_lib
from embedlib.training import setup
from embedlib.training.writers import MetricWriter

# Our progress lines go to their own logger: absl's carries orbax's chatter.
log = logging.getLogger("embedlib.train")


def loss_fn(model, batch):
  """Mean sigmoid cross-entropy of the model's logits on a batch."""
  logits = model(batch["dense"], batch["sparse"])
  return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()


@nnx.jit(donate_argnums=(0, 1))
def train_step(model, optimizer, batch):
  """One step: row gradients for the tables, dense gradients for the rest."""
  loss, grads = optim.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def eval_step(model, batch):
  return model(batch["dense"], batch["sparse"])


def evaluate(model, source, start_state, mesh, max_batches) -> dict:
  """AUC and log-loss over the eval set (every process's rows)."""
  source.set_state(start_state)
  acc = metrics.StreamingMetrics()
  for batch in itertools.islice(source, max_batches):
    batch = data_lib.to_global_batch(batch, mesh)
    logits = eval_step(model, batch)
    acc.update(multihost_utils.process_allgather(batch["label"], tiled=True),
               logits=multihost_utils.process_allgather(logits, tiled=True))
  return acc.result()


def _progress(total, start):
  if not sys.stderr.isatty() or jax.process_index() != 0:
    return None
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains ``config``'s model, evaluating and checkpointing in ``workdir``.

  Resumes from the latest checkpoint in ``workdir`` when there is one.
  Writes ``eval.jsonl`` (one object per eval: ``step``, ``auc``,
  ``logloss``, and ``oracle_auc`` for the synthetic source), ``train.jsonl``
  and TensorBoard event files.

  Args:
    config: a ``ConfigDict`` from one of ``configs/*.py``.
    workdir: the run's directory (created if missing).

  Returns:
    The last eval's metrics.
  """
  setup.validate(config)
  mesh = setup.make_mesh(config)
  spec = setup.data_spec(config)
  train_source, eval_source = setup.sources(config, spec)
  eval_start = eval_source.get_state()
  model, optimizer = setup.model_and_optimizer(config, spec, mesh)
  log.info("mesh %s; embedding plan:\n%s", dict(mesh.shape), model.embeddings.plan)

  oracle = None
  if config.data.source == "synthetic":
    oracle = eval_source.oracle_metrics()
    log.info("planted oracle on the eval set: auc %.4f logloss %.4f",
                 oracle["auc"], oracle["logloss"])

  os.makedirs(workdir, exist_ok=True)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"),
                                 max_to_keep=config.max_checkpoints)
  start = 0
  if ckpt.latest_step() is not None:
    start = ckpt.latest_step()
    train_source.set_state(ckpt.restore(model, optimizer, start))
    log.info("resumed from the checkpoint at step %d", start)

  eval_writer = MetricWriter(workdir, "eval.jsonl")
  train_writer = MetricWriter(workdir, "train.jsonl")
  # Batches are put on the mesh in the prefetch thread, ahead of the step.
  prefetch = data_lib.Prefetcher(train_source, buffer_size=config.data.prefetch,
                                 transform=lambda b: data_lib.to_global_batch(b, mesh))
  bar = _progress(config.num_train_steps, start)
  # Flattening model and optimizer on every call costs ~15 ms of Python per
  # step; cached_partial does it once.
  step_fn = nnx.cached_partial(train_step, model, optimizer)
  result, window, tic = {}, [], time.perf_counter()
  try:
    for step in range(start + 1, config.num_train_steps + 1):
      loss = step_fn(next(prefetch))
      window.append(loss)
      if bar is not None:
        bar.update(1)
      if step % config.log_every == 0 or step == config.num_train_steps:
        mean_loss = float(jnp.mean(jnp.stack(window)))
        elapsed = time.perf_counter() - tic
        rate = len(window) * config.batch_size / elapsed
        eta = (config.num_train_steps - step) * elapsed / len(window)
        log.info("step %d  loss %.4f  %.0f examples/s  eta %.0fs", step, mean_loss, rate, eta)
        train_writer.write(step, {"loss": mean_loss, "examples_per_sec": rate})
        window, tic = [], time.perf_counter()
      if step % config.eval_every == 0 or step == config.num_train_steps:
        result = evaluate(model, eval_source, eval_start, mesh, config.eval_batches)
        scalars = {"auc": result["auc"], "logloss": result["logloss"]}
        if oracle is not None:
          scalars["oracle_auc"] = oracle["auc"]
        log.info("eval at step %d: %s", step,
                     "  ".join(f"{k} {v:.4f}" for k, v in scalars.items()))
        eval_writer.write(step, scalars)
        result = {"step": step, **scalars}
      if step % config.checkpoint_every == 0 or step == config.num_train_steps:
        ckpt.save(step, model, optimizer, prefetch.get_state())
  finally:
    prefetch.close()
    if bar is not None:
      bar.close()
    ckpt.close()
    eval_writer.close()
    train_writer.close()
  return result


def oracle_gap(result: dict) -> float:
  """How far an eval's AUC is below the planted oracle's."""
  return float(result["oracle_auc"] - result["auc"])

