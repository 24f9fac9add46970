"""The training entrypoint end to end: smoke runs, resume, outputs, bad input."""

import json
import logging
import os
import subprocess
import sys

import jax
import pytest

from configs import dlrm_criteo, quickstart
from embedlib import data as data_lib
from embedlib.training import events, setup, train_lib
from embedlib.training.writers import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _messages(caplog):
  return [r.getMessage() for r in caplog.records]


def test_smoke_run_writes_metrics_checkpoints_and_resumes(tmp_path, caplog, monkeypatch):
  config = quickstart.get_config("smoke")
  with config.unlocked():
    config.batch_size = 40  # a shape no other test compiles, so the compile count is this run's
  # Dedup where the plan finds it pays, for skews fitted to the first batch.
  config.model.id_skew, config.model.num_unique = "fit", "auto"
  # The steps' kept temporaries are handed back between the last step's batch and each eval.
  phases, release, evaluate = [], train_lib.host_memory.release_freed, train_lib.evaluate
  next_batch = data_lib.Prefetcher.__next__
  with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles(), monkeypatch.context() as m:
    m.setattr(train_lib.host_memory, "release_freed",
              lambda: phases.append("released") or release())
    m.setattr(train_lib, "evaluate", lambda *a, **k: phases.append("eval") or evaluate(*a, **k))
    m.setattr(data_lib.Prefetcher, "__next__", lambda it: phases.append("batch") or next_batch(it))
    with caplog.at_level(logging.INFO, logger="embedlib"):
      result = train_lib.train_and_evaluate(config, str(tmp_path))
  evals = [i for i, p in enumerate(phases) if p == "eval"]
  assert len(evals) == 2 and all(phases[i - 2:i] == ["batch", "released"] for i in evals), phases
  messages = _messages(caplog)
  # One compile, though its memory is printed before the first step runs it.
  assert sum(m.startswith("Compiling jit(train_step)") for m in messages) == 1
  assert any(m.startswith("train step memory per device, compiled: ") and
             "the plan's embedding: " in m for m in messages)
  assert any(m.startswith("step 1 took") and "compiling train_step included" in m
             for m in messages)
  # Setup and the first compile each say what the wait is for before it starts.
  order = [m.split(" ")[0] for m in messages if m.startswith(
      ("building the model", "mesh ", "compiling train_step", "step 1 took"))]
  assert order == ["building", "mesh", "compiling", "step"], order
  assert any("40 samples per step" in m for m in messages)  # the plan knows the real batch
  skews = json.loads((tmp_path / setup.ID_SKEW_FILE).read_text())
  # Zipf ids, though 5 samples a shard show few repeats: the smallest shard's skew
  assert sorted(skews) == [f"f{i}" for i in range(8)] and max(skews.values()) > 0, skews
  assert any(m.startswith("id_skew per table (config.model.id_skew='fit'): f0 ")
             for m in messages)
  assert "eval data: the synthetic source's eval stream (2 batches" in "\n".join(messages)

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

  # A restarted run resumes after step 6 with the data where it stopped, and
  # the skews (so the plan) the run started with, not fitted again.
  with config.unlocked():
    config.num_train_steps = 9
  with monkeypatch.context() as m:
    m.setattr(setup, "fit_id_skews", lambda *a, **k: pytest.fail("fitted again on resume"))
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert [e["step"] for e in read_jsonl(tmp_path / "eval.jsonl")] == [3, 6, 9]
  assert [r["step"] for r in read_jsonl(tmp_path / "train.jsonl")] == [2, 4, 6, 8, 9]

  # Run again, it is complete: it says so without building a model.
  def no_model(*args):
    raise AssertionError("a finished run built its model")
  monkeypatch.setattr(setup, "model_and_optimizer", no_model)
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="embedlib"):
    again = train_lib.train_and_evaluate(config, str(tmp_path))
  assert again == read_jsonl(tmp_path / "eval.jsonl")[-1]
  assert any("is complete: its newest checkpoint is at step 9 of num_train_steps=9" in m
             for m in _messages(caplog))

  # Serving's restore plans with the run's fitted skews; without them it says what is missing.
  restored, _ = setup.restore_model(config, str(tmp_path))
  assert restored.embeddings.plan["f4"].plan.id_skew == skews["f4"]
  (tmp_path / setup.ID_SKEW_FILE).unlink()
  with pytest.raises(setup.ConfigError, match="id_skew.json is missing: the run's fitted skews"):
    setup.restore_model(config, str(tmp_path))


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


def _criteo_config(train_path, eval_path="", **data):
  config = dlrm_criteo.get_config("smoke")
  with config.unlocked():
    config.data.train_path, config.data.eval_path = str(train_path), str(eval_path)
    config.data.update(data)
  return config


# The raw-id run (test_raw_id_run.py) trains and evaluates on a Criteo holdout
# in CI, and the serving tests train this config's fixed tables: -m slow.
@pytest.mark.slow
def test_criteo_smoke_run_on_a_holdout(tmp_path, caplog):
  path = tmp_path / "day_0.tsv"
  path.write_text(_criteo_lines(400))
  with caplog.at_level(logging.INFO, logger="embedlib"):
    result = train_lib.train_and_evaluate(_criteo_config(path, eval_holdout=0.2),
                                          str(tmp_path / "run"))
  assert result["step"] == 4 and "oracle_auc" not in result
  assert 0.0 <= result["auc"] <= 1.0
  assert f"eval data: a held-out 20.0% of the lines of {path}" in "\n".join(_messages(caplog))


def test_criteo_needs_an_eval_path_or_a_holdout(tmp_path):
  path = tmp_path / "day_0.tsv"
  path.write_text(_criteo_lines(100))
  with pytest.raises(setup.ConfigError, match=r"config.data.eval_path: the criteo source "
                     r"evaluates on a file of its own .* set exactly one"):
    train_lib.train_and_evaluate(_criteo_config(path), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
  # The one-path form of the config holds out 5% and says so.
  config = dlrm_criteo.get_config(str(path))
  assert config.data.eval_holdout == 0.05 and not config.data.eval_path


def test_empty_eval_file_fails_before_training_naming_it(tmp_path):
  train, empty = tmp_path / "day_0.tsv", tmp_path / "eval.tsv"
  train.write_text(_criteo_lines(100))
  empty.write_text("")
  with pytest.raises(setup.ConfigError, match=r"config.data.eval_path: .*eval.tsv holds fewer "
                     r"than batch_size=32 valid lines"):
    train_lib.train_and_evaluate(_criteo_config(train, empty), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_max_bad_lines_minus_one_skips_them_all(tmp_path):
  path = tmp_path / "day_0.tsv"
  path.write_text(_criteo_lines(100, bad_at=(3, 5, 7)))
  config = _criteo_config(path, path, max_bad_lines=-1)
  task = setup.task(config)
  train, evaluation = setup.sources(config, task, task.data_spec())
  assert train.max_bad_lines is None and evaluation.max_bad_lines is None
  assert sum(len(b["label"]) for b in evaluation) == 96  # 97 good lines, batches of 32
  with pytest.raises(setup.ConfigError, match="max_bad_lines: must be >= 0, or -1"):
    setup.validate(_criteo_config(path, path, max_bad_lines=-2))


def test_malformed_criteo_line_stops_with_its_line_number(tmp_path):
  path = tmp_path / "day_0.tsv"
  path.write_text(_criteo_lines(200, bad_at=(3,)))
  config = _criteo_config(path, path)
  with config.unlocked():
    config.num_train_steps = 3
  with pytest.raises(data_lib.CriteoFormatError, match=r"day_0.tsv:4: expected 40"):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))


def test_missing_data_path_fails_before_the_workdir_exists(tmp_path):
  config = dlrm_criteo.get_config(str(tmp_path / "nope.tsv"))
  with pytest.raises(ValueError, match=r"config.data.train_path: .*nope.tsv.* does not exist"):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_data_path_that_is_a_directory_is_called_one(tmp_path):
  config = dlrm_criteo.get_config(str(tmp_path))
  with pytest.raises(setup.ConfigError, match=rf"config.data.train_path: '{tmp_path}' is a "
                     r"directory; pass the path of a .tsv or .tsv.gz file in it"):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, line",
    [
        ("--config.batch_sise=8", "--config.batch_sise: the config has no key 'batch_sise'. "
         'Did you mean "batch_size" instead of "batch_sise"?'),
        ("--config.qqq=1", "--config.qqq: the config has no key 'qqq'. No key is near it: "
         "see configs/quickstart.py for the keys"),
        ("--config.batch_size=abc", "flag --config.batch_size=abc: invalid literal for int()"),
        ("--config.optim.sparse.name=adamw", "error: config.optim.sparse.name: 'adamw'; use one of"),
    ],
)
def test_bad_config_fails_at_start_up_in_one_line(tmp_path, override, line):
  workdir = tmp_path / "run"
  cmd = [sys.executable, "-m", "train", "--config", "configs/quickstart.py:smoke",
         f"--workdir={workdir}", override]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  problems = [l for l in result.stderr.splitlines() if "error" in l.lower()]
  assert len(problems) == 1 and line in problems[0], result.stderr
  assert "Traceback" not in result.stderr
  assert not workdir.exists()


def _read_only(path):
  """``path`` as a directory nobody here can write: a read-only tmpfs as root, else chmod."""
  path.mkdir()
  if os.geteuid() == 0:
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                             capture_output=True)
    if mounted.returncode:
      pytest.skip("root without a read-only mount: every directory is writable")
    return lambda: subprocess.run(["umount", "-l", str(path)], check=False)
  path.chmod(0o500)
  return lambda: path.chmod(0o700)


@pytest.mark.parametrize("where", ["read-only", "under a file"])
def test_unwritable_workdir_fails_before_the_model_in_one_line(tmp_path, where):
  if where == "read-only":
    undo = _read_only(tmp_path / "ro")
    workdir = tmp_path / "ro" / "run"
    line = f"the workdir {workdir} can't be written"
  else:
    (tmp_path / "file").write_text("")
    undo = lambda: None
    workdir = tmp_path / "file" / "run"
    line = f"the workdir {workdir} is under {tmp_path / 'file'}, which is a file"
  cmd = [sys.executable, "-m", "train", "--config", "configs/quickstart.py:smoke",
         f"--workdir={workdir}"]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  try:
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  finally:
    undo()
  assert result.returncode == 1
  (error,) = [l for l in result.stderr.splitlines() if "error" in l.lower()]
  assert line in error and "pass a --workdir" in error, result.stderr
  assert "Traceback" not in result.stderr
  assert "embedding plan" not in result.stderr  # the model was never built


def test_the_last_eval_printed_says_its_step_and_whether_the_run_finished():
  from train.__main__ import _last_eval_line  # pylint: disable=g-import-not-at-top

  result = {"step": 100, "auc": 0.75, "logloss": 0.5}
  assert _last_eval_line(result, 100) == "final eval, at step 100: auc 0.7500  logloss 0.5000"
  stopped = _last_eval_line(result, 1200)  # a signal stopped it at step 150
  assert stopped.startswith("the run stopped before num_train_steps=1200; its last eval, at "
                            "step 100: auc 0.7500") and "final" not in stopped
  assert _last_eval_line({}, 1200) == "no eval ran."


def test_unknown_variant_names_the_choices():
  with pytest.raises(ValueError, match="smoke"):
    quickstart.get_config("tiny")
