"""The training entrypoint end to end: smoke runs, resume, outputs, bad input."""

import os
import subprocess
import sys

import pytest

from configs import dlrm_criteo, quickstart
from embedlib.training import events, train_lib
from embedlib.training.writers import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_run_writes_metrics_checkpoints_and_resumes(tmp_path):
  config = quickstart.get_config("smoke")
  result = train_lib.train_and_evaluate(config, str(tmp_path))
  evals = read_jsonl(tmp_path / "eval.jsonl")
  assert [e["step"] for e in evals] == [3, 6]
  for e in evals:
    assert set(e) == {"step", "auc", "logloss", "oracle_auc"}
    assert 0.0 <= e["auc"] <= 1.0 and e["logloss"] > 0 and 0.5 < e["oracle_auc"] <= 1.0
  assert result["step"] == 6 and result["auc"] == evals[-1]["auc"]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]
  assert [r["step"] for r in read_jsonl(tmp_path / "train.jsonl")] == [2, 4, 6]
  # Loss and examples/s reach TensorBoard beside the eval metrics.
  train_tb = events.read_scalars(str(tmp_path / "tensorboard" / "train"))
  assert {k: [s for s, _ in v] for k, v in train_tb.items()} == {
      "loss": [2, 4, 6], "examples_per_sec": [2, 4, 6]}
  eval_tb = events.read_scalars(str(tmp_path / "tensorboard" / "eval"))
  assert sorted(eval_tb) == ["auc", "logloss", "oracle_auc"]
  assert eval_tb["auc"] == [(3, pytest.approx(evals[0]["auc"])), (6, pytest.approx(evals[1]["auc"]))]

  # A restarted run resumes after step 6 with the data where it stopped.
  with config.unlocked():
    config.num_train_steps = 9
  train_lib.train_and_evaluate(config, str(tmp_path))
  assert [e["step"] for e in read_jsonl(tmp_path / "eval.jsonl")] == [3, 6, 9]
  assert [r["step"] for r in read_jsonl(tmp_path / "train.jsonl")] == [2, 4, 6, 8, 9]


def _criteo_lines(n, bad_at=()):
  lines = []
  for i in range(n):
    if i in bad_at:
      lines.append("not-a-label\t1\n")
      continue
    dense = [str(i % 7)] * 6 + [""] * 7  # empty fields are allowed
    cats = [format((i * 2654435761 + j) % 4096, "x") for j in range(25)] + [""]
    lines.append("\t".join([str(i % 2)] + dense + cats) + "\n")
  return "".join(lines)


def test_criteo_smoke_run(tmp_path):
  path = tmp_path / "day_0.tsv"
  path.write_text(_criteo_lines(200))
  config = dlrm_criteo.get_config("smoke")
  with config.unlocked():
    config.data.train_path = config.data.eval_path = str(path)
  result = train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert result["step"] == 4 and "oracle_auc" not in result
  assert 0.0 <= result["auc"] <= 1.0


def test_malformed_criteo_line_stops_with_its_line_number(tmp_path):
  path = tmp_path / "day_0.tsv"
  path.write_text(_criteo_lines(200, bad_at=(40,)))
  config = dlrm_criteo.get_config("smoke")
  with config.unlocked():
    config.data.train_path = config.data.eval_path = str(path)
    config.num_train_steps = 3
  with pytest.raises(ValueError, match=r"day_0.tsv:41: expected 40"):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))


def test_missing_data_path_fails_before_the_workdir_exists(tmp_path):
  config = dlrm_criteo.get_config(str(tmp_path / "nope.tsv"))
  with pytest.raises(ValueError, match=r"config.data.train_path: .*nope.tsv.* does not exist"):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.batch_sise=8", "batch_sise"),
        ("--config.batch_size=abc", "batch_size"),
        ("--config.optim.sparse.name=adamw", "optim.sparse.name"),
    ],
)
def test_bad_config_fails_at_start_up_naming_the_key(tmp_path, override, message):
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "train", "--config", "configs/quickstart.py:smoke",
         f"--workdir={workdir}", override]
  result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert message in result.stderr
  assert not workdir.exists()


def test_unknown_variant_names_the_choices():
  with pytest.raises(ValueError, match="smoke"):
    quickstart.get_config("tiny")
