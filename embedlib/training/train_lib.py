"""``train_and_evaluate``: the training loop behind ``python -m train``.

Importable (notebooks and tests call it), independent of flags.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from embedlib import checkpoint, dynamic, host_memory, optim
from embedlib import data as data_lib
from embedlib.training import early_stop, pipeline, setup, watchdog
from embedlib.training.loop import Loop
# eval_step and loss_fn are re-exported: callers of the single-task loop import them here.
from embedlib.training.steps import eval_step, loss_fn, train_step  # noqa: F401
from embedlib.training.signals import StopSignals
from embedlib.training.writers import MetricWriter, read_jsonl

# Our progress lines go to their own logger: absl's carries orbax's chatter.
log = logging.getLogger("embedlib.train")


def evaluate(model, source, start_state, mesh, max_batches, task, beat=None) -> dict:
  """``task``'s eval metrics (AUC and log-loss for a ``CTRTask``) over every process's rows.

  Args:
    model: the model ``task`` evaluates (its ``predict`` runs under ``eval_step``).
    source: this process's eval source; read from ``start_state`` each time,
      so every eval sees the same examples.
    start_state: ``source.get_state()`` where the eval starts.
    mesh: the mesh each global batch is laid out on.
    max_batches: batches read (fewer when any process's source ends first).
    task: the run's ``Task``.
    beat: called before each batch after the first (the previous one got
      on: ``watchdog.Watchdog.beat``), or None.

  Returns:
    ``{metric name: float}``, the same on every process.
  """
  source.set_state(start_state)
  local = _while_every_process_has_one(itertools.islice(source, max_batches))
  batches = (data_lib.to_global_batch(task.featurize(b), mesh) for b in local)
  if beat is not None:
    batches = _beating(batches, beat)
  with dynamic.frozen_maps(model):  # eval ids are looked up, never admitted
    return task.evaluate(model, batches, mesh, source)


def _beating(batches, beat):
  """``batches``, calling ``beat`` before each one after the first."""
  for i, batch in enumerate(batches):
    if i:
      beat()
    yield batch


def _while_every_process_has_one(batches):
  """``batches`` while every process still has one: the eval steps are collectives.

  A finite file split by lines can leave processes with different batch
  counts (its length, the hold-out hash and malformed lines all fall unevenly);
  a process that stepped alone would wait on the others forever.
  """
  if jax.process_count() == 1:
    yield from batches
    return
  for batch in itertools.chain(batches, [None]):
    have = multihost_utils.process_allgather(np.int32(batch is not None))
    if not np.all(have):
      return
    yield batch


def _progress(total, start):
  if not sys.stderr.isatty() or jax.process_index() != 0:
    return None
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)


def _last_eval(workdir: str, through_step: int) -> dict:
  path = os.path.join(workdir, "eval.jsonl")
  if not os.path.exists(path):
    return {}
  records = [r for r in read_jsonl(path) if r["step"] <= through_step]
  return records[-1] if records else {}


#: The config of the run in a workdir, written at each start, so a rerun can tell
#: whether it is the same run.
CONFIG_FILE = "config.json"


def _flat_config(tree, prefix="") -> dict:
  """``{"optim.dense.name": "adam", ...}`` of a config's JSON form."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(_flat_config(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _config_json(config) -> dict:
  return json.loads(config.to_json_best_effort())


def _save_config(config, workdir: str) -> None:
  if jax.process_index() == 0:
    with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")


def _config_differences(config, workdir: str, shown: int = 4) -> str | None:
  """What differs between ``config`` and the one saved in ``workdir``; None if nothing.

  A workdir without a saved config (an earlier embedlib's) differs in nothing.
  """
  path = os.path.join(workdir, CONFIG_FILE)
  try:
    with open(path) as f:
      saved = _flat_config(json.load(f))
  except FileNotFoundError:
    return None
  except ValueError as e:
    raise setup.WorkdirError(f"{path} is not a config ({e}); delete it to accept the "
                             "workdir's run as this config's, or pass a new --workdir.") from None
  here = _flat_config(_config_json(config))
  keys = sorted(k for k in set(saved) | set(here)
                if saved.get(k, "absent") != here.get(k, "absent"))
  if not keys:
    return None
  described = [f"{k} is {saved.get(k, 'absent')!r} there, {here.get(k, 'absent')!r} here"
               for k in keys[:shown]]
  more = f" (and {len(keys) - shown} more)" if len(keys) > shown else ""
  return "; ".join(described) + more


def _finished(config, loop: Loop, workdir: str) -> dict | None:
  """The last eval if ``workdir`` already holds the final checkpoint, else None.

  Looks only at the checkpoint directory's listing, so a finished run is
  recognised without building the model or compiling anything.

  Raises:
    setup.WorkdirError: the finished run there had another config.
  """
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return None
  ckpt = checkpoint.Checkpointer(directory)
  try:
    step = ckpt.latest_step()
  finally:
    ckpt.close()
  stopped = early_stop.stopped_at(workdir)
  if step is None or (step < loop.num_train_steps and stopped != step):
    return None
  if _last_eval(workdir, step).get("step") != step:
    return None  # killed after its last checkpoint, before its last eval: _loop runs it
  differences = _config_differences(config, workdir)
  if differences is not None:
    raise setup.WorkdirError(
        f"{workdir} holds a finished run of another config: {differences}. Pass a new "
        f"--workdir for this config, or rerun with the config in "
        f"{os.path.join(workdir, CONFIG_FILE)} to see its result.")
  log.info("%s is complete: its newest checkpoint is at step %d of num_train_steps=%d, so "
           "there is nothing to train. Raise --config.num_train_steps to train on, or pass "
           "a new --workdir.", workdir, step, loop.num_train_steps)
  return _last_eval(workdir, step)


def _stop_agreed(stop: StopSignals, step: int, log_every: int) -> bool:
  """Whether to stop after ``step``; with several processes, all agree at logging steps."""
  if jax.process_count() == 1:
    return stop.requested is not None
  if step % log_every:
    return False
  wanted = np.int32(stop.requested is not None)
  return bool(multihost_utils.process_allgather(wanted).any())


def train_and_evaluate(config, workdir: str, *, stuck_after: float = 600.0) -> dict:
  """Trains ``config``'s model on its task, evaluating and checkpointing in ``workdir``.

  The task (``config.task.name``: ``ctr``, ``ranking``, ``retrieval`` or
  ``sequential``; see
  ``embedlib.training.tasks``) owns the data, the model, the loss and the
  eval metrics; everything else here is the same for each. Resumes from the
  newest checkpoint in ``workdir`` that restores (one that doesn't is moved
  into ``checkpoints/corrupt/`` with a warning); a workdir that already
  holds the final checkpoint returns at once (and raises if that run's
  config, saved as ``config.json`` at each start, differs from ``config``).
  Writes ``eval.jsonl`` (one object per eval: ``step``, the task's
  metrics, e.g. ``auc`` and ``logloss`` for ``ctr``, the planted
  optimum's as ``oracle_*`` for a planted source, and at the last step
  the task's ``test_*`` metrics where it has a test set), ``train.jsonl``
  (``loss``, ``examples_per_sec``, and the task's ``log_scalars``) and
  TensorBoard event files under ``tensorboard/train`` and ``tensorboard/eval``; after a resume, each step
  appears once in each. SIGTERM or SIGINT stops after the current step with
  a checkpoint (it returns normally).

  A program that makes no progress (``watchdog.Watchdog``: ``stuck_after``
  seconds without, or a collective XLA reports stuck) ends the process
  with exit status ``watchdog.STUCK``, naming the program, the step and the
  collective; SIGTERM or SIGINT during a wait that does not end within
  seconds ends it at once, saying so. The checkpoints are left as they are.

  On glibc, freed memory is kept in the process for the next step
  (``embedlib.host_memory``; ``EMBEDLIB_KEEP_FREED_BLOCKS=0`` leaves glibc's
  defaults).

  Args:
    config: a ``ConfigDict`` from one of ``configs/*.py``.
    workdir: the run's directory (created if missing).
    stuck_after: seconds a program the loop waits on may go without
      progress (its first call, which compiles it, aside); 0: no limit.

  Returns:
    The last eval's metrics (``{}`` if none ran).

  Raises:
    setup.WorkdirError: ``workdir`` can't be written (before the model is
      built), or holds a finished run of another config.
    checkpoint.CheckpointSaveError: a checkpoint could not be written; the
      earlier ones are intact.
    writers.MetricWriteError: a metrics file could not be written.
  """
  # Before anything is allocated: a step's temporaries are then reused from
  # step to step instead of faulted in afresh (host_memory).
  host_memory.keep_freed_blocks()
  # Built once: every step below takes it. Its data is read with what the
  # workdir holds (a saved schema), and sets the steps of an epochs' run.
  task = setup.task(config).for_workdir(workdir)
  setup.resolve_epochs(config, task)
  loop = Loop.from_config(config)
  done = _finished(config, loop, workdir)
  if done is not None:
    return done
  mesh = setup.make_mesh(config)
  spec = task.data_spec()
  described = task.describe_data()
  if described:
    log.info("data: %s", described)
  train_source, eval_source = setup.sources(config, task, spec)
  eval_start = eval_source.get_state()
  log.info("eval data: %s", setup.describe_eval(config, task))
  setup.check_workdir(workdir)
  # Building and placing large tables takes a while with nothing else to show.
  id_skews = setup.fitted_id_skews(config, task, spec, train_source, mesh, workdir)
  if id_skews is not None:
    log.info("id_skew per table (config.model.id_skew='fit'): %s",
             ", ".join(f"{k} {v:g}" for k, v in id_skews.items()))
  log.info("building the model and optimizer ...")
  model, optimizer = setup.model_and_optimizer(config, task, spec, mesh, id_skews)
  log.info("mesh %s; embedding plan:\n%s", dict(mesh.shape), _plans(model))

  oracle = task.oracle(eval_source)
  eval_source.set_state(eval_start)
  if oracle:
    log.info("planted oracle on the eval set: %s", _line(oracle))

  # Created once the model is built: a config error found while building it
  # leaves nothing behind.
  os.makedirs(workdir, exist_ok=True)
  _save_config(config, workdir)
  task.save(workdir)
  setup.save_id_skews(workdir, id_skews)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"),
                                 max_to_keep=loop.max_checkpoints)
  stopper = None
  try:
    start = 0
    found = ckpt.restore_newest(model, optimizer)
    if found is not None:
      start, data_state = found
      train_source.set_state(data_state)
      log.info("resumed from the checkpoint at step %d", start)

    stopper = _early_stopping(config, task, workdir, start)
    if stopper is not None and stopper.stop:  # killed after its last save, before the mark
      if jax.process_index() == 0:
        early_stop.mark_stopped(workdir, start, stopper)
      return _last_eval(workdir, start)

    def run_eval(step, beat=None):
      """The eval at ``step``, counted by early stopping (which keeps the best's weights)."""
      scalars = {**evaluate(model, eval_source, eval_start, mesh, loop.eval_batches, task,
                            beat), **oracle}
      if stopper is not None:
        stopper.observe(step, scalars, model, optimizer, train_source.get_state())
      return {"step": step, **scalars}

    def finish(result):
      """The last eval, with the held-out test set's metrics: once, at the end."""
      result = dict(result)
      if stopper is not None:  # the test rows are scored with the best eval's weights
        result["best_step"] = int(stopper.restore_best(model, _trained_keys(task, model)))
        log.info("the best eval was at step %d; its weights are the model's now",
                 result["best_step"])
      with dynamic.frozen_maps(model):  # nor are the test set's
        result.update(task.test(model, eval_source, mesh))
      return result

    newest = lambda: _newest_checkpoint(ckpt.directory)
    with StopSignals() as stop, watchdog.Watchdog(limit_s=stuck_after, newest=newest) as dog:
      return _loop(loop, workdir, start, model, optimizer, train_source, mesh, ckpt,
                   (run_eval, finish), stop, task, dog, stopper)
  finally:
    ckpt.close()
    if stopper is not None:
      stopper.close()


def _early_stopping(config, task, workdir: str, start: int):
  """The run's ``EarlyStopping`` (``config.early_stopping`` evals of patience), or None."""
  patience = config.get("early_stopping", 0)
  watched = task.early_stopping_metric()
  if not patience or watched is None:
    return None
  return early_stop.EarlyStopping(workdir, patience, *watched, resume_step=start)


def _trained_keys(task, model) -> tuple[str, ...]:
  """The tables a row-wise rule trains (stored apart in a checkpoint)."""
  return tuple(k for k, _ in optim.sparse_tables(model)) if task.sparse_tables else ()


def one_step_in_flight() -> bool:
  """Whether to finish each step before dispatching the next: on several CPU devices.

  XLA:CPU runs the in-process collectives of the simulated devices on a
  shared thread pool, where a participant waiting at a collective holds its
  thread. With the next step (or the loss mean) dispatched behind a running
  step, two-tower runs stopped in a collective with participants missing,
  and XLA aborted them after its collective timeout; finishing each step
  first, the same runs completed. The simulated devices share the CPU cores
  anyway, so little overlap is lost; accelerators keep their queue.
  """
  return jax.default_backend() == "cpu" and jax.local_device_count() > 1


def _plans(model) -> str:
  """The plan of every table: the collection's table, or one line per ``ShardedEmbed``."""
  embeddings = getattr(model, "embeddings", None)
  if embeddings is not None and hasattr(embeddings, "plan"):
    return str(embeddings.plan)  # its dynamic tables included, with their rows, slots and map
  return "\n".join(f"{key}: {emb.plan}" for key, emb in optim.sparse_tables(model))


def _newest_checkpoint(directory: str) -> str:
  """The newest finished checkpoint in ``directory``, in words (a listing: safe while stuck)."""
  try:
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
  except OSError:
    steps = []
  return f"step {max(steps)}, in {directory}" if steps else f"none yet in {directory}"


def _line(scalars: dict) -> str:
  return "  ".join(f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}"
                   for k, v in scalars.items())


def _loop(loop: Loop, workdir, start, model, optimizer, train_source, mesh, ckpt, evals, stop,
          task, dog, stopper=None):
  """Steps ``start + 1 .. num_train_steps``; returns the last eval.

  ``evals``: ``(run_eval, finish)``: ``run_eval(step, beat)`` gives an eval's
  record, and ``finish(record)`` the last one's, with the test metrics.
  ``dog``: the run's ``watchdog.Watchdog``, which every wait on a program is under.
  """
  run_eval, finish = evals
  train_writer = MetricWriter(workdir, "train", resume_step=start)
  eval_writer = MetricWriter(workdir, "eval", resume_step=start)

  def write_eval(result):
    scalars = {k: v for k, v in result.items() if k != "step"}
    log.info("eval at step %d: %s", result["step"], _line(scalars))
    eval_writer.write(result["step"], scalars)

  # Batches are put on the mesh in the prefetch thread, ahead of the step.
  prefetch = data_lib.Prefetcher(
      train_source, buffer_size=loop.prefetch,
      transform=lambda b: data_lib.to_global_batch(task.featurize(b), mesh))
  bar = _progress(loop.num_train_steps, start)
  # nnx.jit flattens its module arguments on every call; cached_partial does
  # it once for the whole run.
  step_fn = nnx.cached_partial(train_step, model, optimizer)
  if loop.pipeline:
    # Batch N+1's ids are distributed in step N's program; checkpoints record
    # the data position after the batch trained on, not the one read ahead.
    runner = pipeline.Pipeline(model, optimizer, prefetch, task, source=train_source,
                               early_fetch=loop.early_fetch)
    take_step, data_state = runner.step, runner.get_state
    first_step = take_step
    program = "pipelined_train_step"
  else:
    take_step = lambda: step_fn(next(prefetch), task=task)
    data_state = prefetch.get_state

    def first_step():
      batch = next(prefetch)
      # The compile this reads the memory of is the one the step then runs.
      log.info("%s", setup.describe_step_memory(train_step, model, optimizer, batch, task=task))
      return step_fn(batch, task=task)
    program = "train_step"
  sync = one_step_in_flight()
  result = _last_eval(workdir, start)
  saved, step = start, start
  losses, timed, paused, tic = [], 0, 0.0, time.perf_counter()
  try:
    if start == loop.num_train_steps and result.get("step") != start:
      # The last checkpoint of a run whose last eval was not written (_finished).
      with dog.waiting("the eval (eval_step)", start):
        result = finish(run_eval(start, dog.beat))
      write_eval(result)
    for step in range(start + 1, loop.num_train_steps + 1):
      if step == start + 1:
        log.info("compiling train_step (step %d waits for it) ...", step)
      with dog.waiting(program, step):
        loss = first_step() if step == start + 1 else take_step()
        if sync or step == start + 1:
          jax.block_until_ready(loss)
      losses.append(loss)
      if step == start + 1:
        log.info("step %d took %.1fs, compiling train_step included; examples/s leave "
                 "it out", step, time.perf_counter() - tic)
        tic = time.perf_counter()
      else:
        timed += 1
      if bar is not None:
        bar.update(1)
      if loop.logs(step):
        # On the host: a device program here would run beside the steps in flight.
        with dog.waiting(program, step):
          mean_loss = float(np.mean(jax.device_get(losses)))
        # Dynamic tables' occupancy and their last step's admitted, evicted, default_share.
        scalars = {"loss": mean_loss, **task.log_scalars(model), **dynamic.step_stats(model)}
        if timed:
          elapsed = time.perf_counter() - tic - paused
          scalars["examples_per_sec"] = timed * loop.batch_size / elapsed
          eta = (loop.num_train_steps - step) * elapsed / timed
          log.info("step %d  loss %.4f  %.0f examples/s  eta %.0fs", step, mean_loss,
                   scalars["examples_per_sec"], eta)
        else:
          log.info("step %d  loss %.4f", step, mean_loss)
        train_writer.write(step, scalars)
        losses, timed, paused, tic = [], 0, 0.0, time.perf_counter()
      is_eval, is_save = loop.evaluates(step), loop.saves(step)
      if is_eval or is_save:
        with dog.waiting(program, step):
          jax.block_until_ready(loss)  # the steps' own time stays out of `paused`
        # The steps' kept temporaries go back before the eval's and the writers'
        # own are allocated beside them; the next step faults its block in once.
        host_memory.release_freed()
        pause = time.perf_counter()
        if is_eval:
          with dog.waiting("the eval (eval_step)", step):
            result = run_eval(step, dog.beat)
          if step == loop.num_train_steps or (stopper is not None and stopper.stop):
            if stopper is not None:
              # The trained weights first, which the best eval's replace for the test
              # rows: a run raised to more steps trains on from these, as if never stopped.
              with stop.deferred(), dog.waiting("a checkpoint save", step):
                ckpt.save(step, model, optimizer, data_state())
              saved = step
            with dog.waiting("the test eval (eval_step)", step):
              result = finish(result)
          write_eval(result)
        if is_save and saved < step:
          with stop.deferred(), dog.waiting("a checkpoint save", step):
            ckpt.save(step, model, optimizer, data_state())
          saved = step
        paused += time.perf_counter() - pause
      with stop.deferred():
        ckpt.check()  # with background saves, a failed one stops the run here
      if stopper is not None and stopper.stop:
        if jax.process_index() == 0:
          early_stop.mark_stopped(workdir, step, stopper)
        log.info("stopped early at step %d: %d evals without a better %s (config."
                 "early_stopping=%d)", step, stopper.since, stopper.metric, stopper.patience)
        break
      if _stop_agreed(stop, step, loop.log_every):
        break
    if stop.requested is not None and step < loop.num_train_steps:
      with stop.deferred(), dog.waiting("a checkpoint save", step):
        if saved < step:
          ckpt.save(step, model, optimizer, data_state())
        ckpt.wait()
      log.info("stopped by %s at step %d of %d; the checkpoint at step %d is in %s. "
               "Rerun the same command to resume.", stop.requested, step,
               loop.num_train_steps, step, ckpt.directory)
  finally:
    prefetch.close()
    if bar is not None:
      bar.close()
    eval_writer.close()
    train_writer.close()
  return result


def oracle_gap(result: dict) -> float:
  """How far an eval's AUC is below the planted oracle's.

  Args:
    result: an eval's metrics with ``auc`` and ``oracle_auc`` (a planted source).

  Returns:
    ``oracle_auc - auc``.

  >>> oracle_gap({"auc": 0.80, "oracle_auc": 0.81})
  0.01...
  """
  return float(result["oracle_auc"] - result["auc"])
