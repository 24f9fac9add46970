"""Early stopping on the eval split: stop after ``patience`` evals without a better one.

The task names the metric it watches (``Task.early_stopping_metric``: the
AUC of a click model, the two towers' recall). Each eval that improves it
saves the model into ``<workdir>/best`` (a checkpoint of its own, one
kept), so the weights of the best eval outlive the rolling checkpoints and
a restart; at the end of the run (by the patience or at the last step) the
model is restored from there before the test rows are scored, as RecBole
scores its test split with its best validation model; the run's last
checkpoint, saved before that, keeps the trained weights (a run raised to
more steps trains on from them), and ``setup.restore_model`` (an export)
reads the best. The history is read back from ``eval.jsonl`` on a resume,
so a resumed run stops where an uninterrupted one does.
"""

from __future__ import annotations

import json
import math
import os

from embedlib import checkpoint
from embedlib.training.writers import read_jsonl

BEST_DIR = "best"
#: What a run that stopped early writes in its workdir (its step and why).
STOPPED_FILE = "stopped_early.json"


class EarlyStopping:
  """Watches ``metric`` over the evals (see the module docstring).

  Args:
    workdir: the run's directory.
    patience: evals without improvement before stopping.
    metric: the eval metric's name; ``higher``: whether larger is better.
    resume_step: the step a resumed run starts from (its earlier evals
      are read from ``eval.jsonl``).
  """

  def __init__(self, workdir: str, patience: int, metric: str, higher: bool,
               resume_step: int = 0):
    self.workdir, self.patience, self.metric, self.higher = workdir, patience, metric, higher
    self.best_step, self.best, self.since = 0, -math.inf if higher else math.inf, 0
    self.stop = False
    self.ckpt = checkpoint.Checkpointer(os.path.join(workdir, BEST_DIR), max_to_keep=1)
    path = os.path.join(workdir, "eval.jsonl")
    if resume_step and os.path.exists(path):
      for record in read_jsonl(path):
        if record["step"] <= resume_step and metric in record:
          self._count(record["step"], record[metric])

  def _better(self, value: float) -> bool:
    return value > self.best if self.higher else value < self.best

  def _count(self, step: int, value: float) -> bool:
    improved = math.isfinite(value) and self._better(value)
    if improved:
      self.best, self.best_step, self.since = value, step, 0
    else:
      self.since += 1
    self.stop = self.since >= self.patience
    return improved

  def observe(self, step: int, result: dict, model, optimizer, data_state: dict) -> None:
    """Counts one eval; saves the model as the best where it improves the metric."""
    if self.metric not in result:
      raise ValueError(f"config.early_stopping watches {self.metric!r}, which the eval does "
                       f"not report ({sorted(result)}); set config.early_stopping=0.")
    if self._count(step, float(result[self.metric])):
      self.ckpt.save(step, model, optimizer, data_state)
      self.ckpt.wait()

  def restore_best(self, model, keys: tuple[str, ...]) -> int:
    """Loads the best eval's weights into ``model``; returns that eval's step (0: none)."""
    if self.ckpt.latest_step() is None:
      return 0
    return self.ckpt.restore_model(model, keys)

  def close(self) -> None:
    self.ckpt.close()


def has_best(workdir: str) -> bool:
  """Whether ``workdir`` holds a best eval's weights (a run with early stopping that evaluated)."""
  path = os.path.join(workdir, BEST_DIR)
  if not os.path.isdir(path):
    return False
  ckpt = checkpoint.Checkpointer(path)
  try:
    return ckpt.latest_step() is not None
  finally:
    ckpt.close()


def mark_stopped(workdir: str, step: int, stopper: EarlyStopping) -> None:
  """Records that the run ended at ``step`` by early stopping (a rerun then has nothing to do)."""
  path = os.path.join(workdir, STOPPED_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump({"step": step, "best_step": stopper.best_step, "metric": stopper.metric,
               "best": stopper.best}, f)
  os.replace(tmp, path)


def stopped_at(workdir: str) -> int | None:
  """The step a run in ``workdir`` stopped early at, or None."""
  path = os.path.join(workdir, STOPPED_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return int(json.load(f)["step"])
