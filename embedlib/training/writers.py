"""Where a run's metrics go: ``<name>.jsonl`` and ``tensorboard/<name>/`` in the workdir.

A resumed run starts again after its checkpoint's step, so on opening, the
records of later steps (written before the interruption) are dropped from
both, and every step appears once. Train and eval write to their own
TensorBoard directories, so neither overwrites the other's event file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import jax

from embedlib.training import events


class MetricWriteError(OSError):
  """A metrics file could not be written; the message names the file and the cause."""


def _json_value(value: float):
  # JSON has no NaN or Infinity: null keeps each line valid JSON.
  return value if math.isfinite(value) else None


def _rewrite_jsonl(path: str, keep_through_step: int) -> None:
  """Keeps the records of steps up to ``keep_through_step`` (and drops a torn last line)."""
  if not os.path.exists(path):
    return
  kept = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if record.get("step", 0) <= keep_through_step:
        kept.append(line if line.endswith("\n") else line + "\n")
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)


@contextlib.contextmanager
def _reporting(path: str):
  """Turns an OSError while writing ``path`` into a ``MetricWriteError`` naming it."""
  try:
    yield
  except MetricWriteError:
    raise
  except OSError as e:
    raise MetricWriteError(
        f"could not write metrics to {path}: {e.strerror or e}. Free space (or fix the "
        "directory), then rerun: training resumes from the newest checkpoint.") from None


class MetricWriter:
  """Writes scalars to ``workdir/<name>.jsonl`` and ``workdir/tensorboard/<name>/``.

  Process 0 writes; the others' writers do nothing. Each ``write`` appends
  one JSON object (``step`` plus the scalars; non-finite values as
  ``null``) and one TensorBoard event.

  Args:
    workdir: the run's directory.
    name: ``"train"`` or ``"eval"``: the JSONL file's stem and the
      TensorBoard subdirectory.
    resume_step: the step the run resumes from (0 for a fresh run): records
      after it, left by an interrupted run, are dropped.

  Raises:
    MetricWriteError: a file could not be written (e.g. a full disk).
  """

  def __init__(self, workdir: str, name: str, *, resume_step: int = 0):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, f"{name}.jsonl")
    self.logdir = os.path.join(workdir, "tensorboard", name)
    self._events = None
    if self.enabled:
      with _reporting(self.path):
        _rewrite_jsonl(self.path, resume_step)
      with _reporting(self.logdir):
        self._events = events.EventFile(self.logdir, keep_through_step=resume_step)

  def write(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    values = {k: float(v) for k, v in scalars.items()}
    # An int stays one in the JSON (best_step names a checkpoint: 6, not 6.0).
    record = {"step": int(step), **{k: v if type(v) is int else _json_value(values[k])
                                    for k, v in scalars.items()}}
    with _reporting(self.path):
      with open(self.path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")
    with _reporting(self._events.path):
      self._events.write(step, values)

  def close(self) -> None:
    if self._events is not None:
      self._events.close()


def read_jsonl(path: str) -> list[dict]:
  """The records of a metrics JSONL file, in order.

  Args:
    path: a workdir's ``train.jsonl`` or ``eval.jsonl``.

  Returns:
    One dict per line (blank lines skipped).
  """
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
