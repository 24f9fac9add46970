"""Metrics files after a resume: each step once, in JSONL and in TensorBoard."""

import json
import os

import pytest

from embedlib.training import events
from embedlib.training.writers import MetricWriteError, MetricWriter, read_jsonl


def _write(workdir, name, steps, resume_step=0):
  writer = MetricWriter(str(workdir), name, resume_step=resume_step)
  for step in steps:
    writer.write(step, {"loss": step / 10, "examples_per_sec": 100.0 * step})
  writer.close()


def test_resume_drops_the_redone_steps_from_jsonl_and_tensorboard(tmp_path):
  _write(tmp_path, "train", [1, 2, 3, 4, 5])
  with open(tmp_path / "train.jsonl", "a") as f:
    f.write('{"step": 6, "lo')  # torn by a kill -9 mid-write
  _write(tmp_path, "train", [4, 5, 6, 7], resume_step=3)

  assert [r["step"] for r in read_jsonl(tmp_path / "train.jsonl")] == [1, 2, 3, 4, 5, 6, 7]
  logdir = tmp_path / "tensorboard" / "train"
  assert len(events.event_files(str(logdir))) == 1
  scalars = events.read_scalars(str(logdir))
  assert sorted(scalars) == ["examples_per_sec", "loss"]
  assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4, 5, 6, 7]
  assert scalars["loss"][2] == (3, pytest.approx(0.3))


def test_train_and_eval_write_separate_event_files(tmp_path):
  _write(tmp_path, "train", [1, 2])
  evals = MetricWriter(str(tmp_path), "eval")
  evals.write(2, {"auc": 0.75})
  evals.close()
  assert set(events.read_scalars(str(tmp_path / "tensorboard" / "train"))) == {
      "loss", "examples_per_sec"}
  assert events.read_scalars(str(tmp_path / "tensorboard" / "eval")) == {"auc": [(2, 0.75)]}


def test_non_finite_values_stay_valid_json(tmp_path):
  writer = MetricWriter(str(tmp_path), "eval")
  writer.write(1, {"auc": float("nan"), "logloss": float("inf")})
  writer.close()
  line = (tmp_path / "eval.jsonl").read_text()
  assert json.loads(line) == {"step": 1, "auc": None, "logloss": None}


def test_an_int_stays_an_int_in_the_json(tmp_path):
  writer = MetricWriter(str(tmp_path), "eval")
  writer.write(6, {"auc": 0.5, "best_step": 3})
  writer.close()
  record = json.loads((tmp_path / "eval.jsonl").read_text())
  assert record == {"step": 6, "auc": 0.5, "best_step": 3} and type(record["best_step"]) is int
  assert events.read_scalars(str(tmp_path / "tensorboard" / "eval"))["best_step"] == [(6, 3.0)]


def test_an_unwritable_metrics_file_names_its_path(tmp_path):
  writer = MetricWriter(str(tmp_path), "train")
  os.mkdir(tmp_path / "train.jsonl")  # a directory where the file should be
  with pytest.raises(MetricWriteError, match=r"could not write metrics to .*train.jsonl: "):
    writer.write(1, {"loss": 0.5})
  writer.close()
