"""Where a run's metrics go: a JSONL file and TensorBoard event files."""

from __future__ import annotations

import json
import os

import jax


class MetricWriter:
  """Writes scalars to ``workdir/<name>`` (JSONL) and TensorBoard (process 0 only).

  Each ``write`` call appends one JSON object (``step`` plus the scalars) to
  the JSONL file and one scalar per key to the event files, through
  tensorboardX.

  Args:
    workdir: the run's directory.
    name: JSONL file name, e.g. ``eval.jsonl``.
  """

  def __init__(self, workdir: str, name: str):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(workdir, name)
    self._tb = None
    if self.enabled:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, scalars: dict) -> None:
    if not self.enabled:
      return
    record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(record) + "\n")
    for key, value in scalars.items():
      self._tb.add_scalar(key, float(value), int(step))
    self._tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def read_jsonl(path: str) -> list[dict]:
  """The records of a metrics JSONL file, in order."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
