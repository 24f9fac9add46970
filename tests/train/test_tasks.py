"""The ranking and retrieval tasks through the training loop: metrics, resume, restore, bad config.

Each smoke run compiles its train step once; the restore onto 4 devices
compares the eval step's outputs with the 8-device model's, to 1e-5
(the mesh changes the order of some float sums).
"""

import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from configs import ranker, two_tower
from embedlib import checkpoint
from embedlib import data as data_lib
from embedlib.training import events, setup, steps, train_lib
from embedlib.training.writers import read_jsonl

CONFIGS = {"ranking": ranker, "retrieval": two_tower}
METRICS = {
    "ranking": {"auc/click", "auc/like", "auc/reply", "auc/share", "auc/dwell", "auc_mean",
                "ndcg@4"},
    "retrieval": {"recall@1", "recall@10"},
}


def _mesh(n):
  return jax.make_mesh((n,), ("batch",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def smoke_run(request, tmp_path_factory):
  """A smoke run of each task, resumed from step 6 to 9: (task name, config, workdir, log)."""
  config = CONFIGS[request.param].get_config("smoke")
  workdir = tmp_path_factory.mktemp(request.param)
  handler = logging.Handler()
  handler.records = []
  handler.emit = handler.records.append
  logging.getLogger("jax").addHandler(handler)
  try:
    with jax.log_compiles():
      train_lib.train_and_evaluate(config, str(workdir))
    with config.unlocked():
      config.num_train_steps = 9
    train_lib.train_and_evaluate(config, str(workdir))
  finally:
    logging.getLogger("jax").removeHandler(handler)
  return request.param, config, workdir, [r.getMessage() for r in handler.records]


def test_metrics_beside_the_oracle_and_one_compile(smoke_run):
  task, _, workdir, messages = smoke_run
  assert sum(m.startswith("Compiling jit(train_step)") for m in messages) == 1
  evals = read_jsonl(workdir / "eval.jsonl")
  assert [e["step"] for e in evals] == [3, 6, 9]
  want = METRICS[task] | {f"oracle_{k}" for k in METRICS[task]} | {"step"}
  assert set(evals[-1]) == want
  for key in METRICS[task]:
    assert all(0.0 <= e[key] <= 1.0 for e in evals), key
    assert evals[-1][f"oracle_{key}"] == evals[0][f"oracle_{key}"]  # one eval set
  if task == "ranking":  # the planted optimum is far from chance
    assert evals[-1]["oracle_auc_mean"] > 0.7 and evals[-1]["oracle_ndcg@4"] > 0.8
  else:
    assert evals[-1]["oracle_recall@10"] > 0.2
  train = read_jsonl(workdir / "train.jsonl")
  assert [r["step"] for r in train] == [2, 4, 6, 8, 9]
  tags = set(events.read_scalars(str(workdir / "tensorboard" / "train")))
  assert tags == {"loss", "examples_per_sec"} | ({"temperature"} if task == "retrieval" else set())
  assert sorted(events.read_scalars(str(workdir / "tensorboard" / "eval"))) == sorted(want - {"step"})
  assert sorted(os.listdir(workdir / "checkpoints")) == ["6", "9"]


def test_restore_onto_fewer_devices_predicts_the_same(smoke_run):
  task_name, config, workdir, _ = smoke_run
  task = setup.task(config)
  spec = task.data_spec()
  _, eval_source = setup.sources(config, task, spec)
  batch = task.featurize(next(eval_source))
  ckpt = checkpoint.Checkpointer(str(workdir / "checkpoints"))
  outputs = []
  for n in (8, 4):
    mesh = _mesh(n)
    model, optimizer = setup.model_and_optimizer(config, task, spec, mesh)
    assert ckpt.restore(model, optimizer) == {"position": 9}
    outputs.append(np.asarray(steps.eval_step(model, data_lib.to_global_batch(batch, mesh),
                                              task=task)))
    if task_name == "retrieval":  # the streaming log-Q estimate came back with the model
      assert int(model.frequency.step[...]) == 9
  ckpt.close()
  np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module, key, value, match", [
    (ranker, "task.name", "rank", r"config.task.name: 'rank'; use one of \('ctr', 'ranking', "
     r"'retrieval', 'sequential', 'tabular'\)"),
    (ranker, "model.name", "two_tower", r"config.model.name: 'two_tower' can't train the "
     r"ranking task; use one of \('ranker',\)"),
    (ranker, "task.ndcg_weights", (1.0, 2.0), r"config.task.ndcg_weights: has 2 entries for 5 "
     r"actions"),
    (ranker, "model.user_hash.num_hashes", 0, r"config.model.user_hash.num_hashes must be an "
     r"int >= 1"),
    (ranker, "model.num_heads", 3, r"config.model.width=16 must divide into num_heads=3"),
    (two_tower, "model.temperature", 0.0, r"config.model.temperature=0.0 .* can't work.*must "
     r"be > 0"),
    (two_tower, "model.temperature", 2.0, r"config.model.temperature=2.0 .* at most 1"),
    (two_tower, "task.log_q", "sampled", r"config.task.log_q: 'sampled'; use one of"),
    (two_tower, "model.item_hash.num_hashes", 2000, r"config.model.item_hash.num_hashes=2000: "
     r"at most 16"),
])
def test_bad_config_fails_before_the_workdir_naming_the_key(tmp_path, module, key, value, match):
  config = module.get_config("smoke")
  with config.unlocked():
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  with pytest.raises(setup.ConfigError, match=match):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_processes_train_like_one(smoke_run, tmp_path):
  """2 processes x 4 CPU devices reproduce the one-process smoke run's first 6 steps (1e-4)."""
  from tests.train import test_multihost as multihost  # pylint: disable=import-outside-toplevel

  task, _, single, _ = smoke_run
  config_file = {"ranking": "configs/ranker.py:smoke", "retrieval": "configs/two_tower.py:smoke"}
  port = multihost._free_port()
  procs = [
      subprocess.Popen(
          [sys.executable, "-m", "train", "--config", config_file[task],
           f"--workdir={tmp_path}", f"--coordinator_address=127.0.0.1:{port}",
           "--num_processes=2", f"--process_id={i}"],
          cwd=multihost.ROOT, env=multihost._env(4), stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, text=True)
      for i in range(2)
  ]
  outputs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]
  one = [r for r in read_jsonl(single / "train.jsonl") if r["step"] <= 6]
  two = read_jsonl(tmp_path / "train.jsonl")
  assert [r["step"] for r in two] == [r["step"] for r in one] == [2, 4, 6]
  np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-4)
  one = [r for r in read_jsonl(single / "eval.jsonl") if r["step"] <= 6]
  two = read_jsonl(tmp_path / "eval.jsonl")
  assert [r["step"] for r in two] == [3, 6]
  for key in METRICS[task]:
    np.testing.assert_allclose([r[key] for r in two], [r[key] for r in one], rtol=1e-4,
                               atol=1e-6, err_msg=key)
