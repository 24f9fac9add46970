"""The sequential task trained on a tiny ML-100K-format file: metrics, resume, bad config.

One smoke run (``configs/movielens.py:smoke``, 9 steps) serves the fast
tests; the slow one runs it again to step 6, resumes to 9 and compares.
"""

import os

import numpy as np
import optax
import pytest
from flax import nnx

from configs import movielens
from embedlib import ShardedEmbed, optim
from embedlib.training import events, setup, train_lib
from embedlib.training.tasks import ConfigError
from embedlib.training.writers import read_jsonl
from tests import benchmark_scripts

METRICS = {f"{m}@{k}" for m in ("hr", "ndcg", "mrr") for k in (10, 20)}


def write_ml100k(folder, num_users=40, num_items=60, seed=0):
  """``u.data`` as GroupLens ships it: user, item, rating, timestamp, tab-separated."""
  rng = np.random.default_rng(seed)
  folder.mkdir()
  lines = []
  for user in range(1, num_users + 1):
    count = rng.integers(5, 16)
    items = rng.choice(num_items, count, replace=False) + 1
    for t, item in enumerate(items):
      lines.append(f"{user}\t{item}\t{rng.integers(1, 6)}\t{880000000 + 3600 * t + user}\n")
  (folder / "u.data").write_text("".join(lines))
  return folder


def _config(path, steps):
  config = movielens.get_config("smoke")
  config.data.path = str(path)
  config.num_train_steps = steps
  return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The data folder and the smoke run's workdir."""
  data = write_ml100k(tmp_path_factory.mktemp("data") / "ml-100k")
  straight = tmp_path_factory.mktemp("straight")
  train_lib.train_and_evaluate(_config(data, 9), str(straight))
  return data, straight


def test_metrics_on_validation_at_each_eval_and_on_test_at_the_end(runs):
  _, straight = runs
  evals = read_jsonl(straight / "eval.jsonl")
  assert [e["step"] for e in evals] == [3, 6, 9]
  assert set(evals[0]) == METRICS | {"step"}
  assert set(evals[-1]) == METRICS | {f"test_{k}" for k in METRICS} | {"step"}
  for e in evals:
    for k in e.keys() - {"step"}:
      assert 0.0 <= e[k] <= 1.0, k
    assert e["hr@10"] <= e["hr@20"] and e["ndcg@10"] <= e["hr@10"]
  assert evals[-1]["test_hr@20"] > 0  # 60 items, 20 ranked: a hit is near certain
  tags = set(events.read_scalars(str(straight / "tensorboard" / "eval")))
  assert tags == set(evals[-1]) - {"step"}
  train = read_jsonl(straight / "train.jsonl")
  assert [r["step"] for r in train] == [2, 4, 6, 8, 9]
  assert all(np.isfinite(r["loss"]) for r in train)


def test_the_top_ten_script_reproduces_the_test_eval(runs, tmp_path):
  """``benchmarks/movielens_top10.py`` on the smoke run: its NDCG@10 is the eval's, also in
  its ``--json`` record."""
  _, straight = runs
  script = benchmark_scripts.load("movielens_top10")
  m = script.measure(str(straight))
  script.main([str(straight), "--json", str(tmp_path / "run.json")])
  record = benchmark_scripts.read_record(tmp_path / "run.json", ["input_left_out_over_ranked"])
  cases = {c["name"]: c["median"] for c in record["cases"]}
  assert cases["test ndcg@10, ranked"] == pytest.approx(m["ranked"][0])
  test = read_jsonl(straight / "eval.jsonl")[-1]
  np.testing.assert_allclose(m["ranked"], (test["test_ndcg@10"], test["test_hr@10"]),
                             rtol=1e-5)
  assert m["repeat_logit"] is not None and m["users"] == 40
  assert 0.0 <= m["in_input"] <= m["in_history"] <= 1.0
  # Leaving out movies that are never the target can only lift it.
  assert m["ranked"][0] <= m["input_left_out"][0] <= m["history_left_out"][0]


@pytest.mark.slow
def test_a_resumed_run_equals_an_uninterrupted_one(runs, tmp_path):
  data, straight = runs
  resumed = tmp_path / "resumed"
  train_lib.train_and_evaluate(_config(data, 6), str(resumed))
  train_lib.train_and_evaluate(_config(data, 9), str(resumed))
  # Step 6 is inside the second epoch (4 batches of 16 windows each): the data
  # position, the dropout seeds and the optimizer come back exactly.
  assert sorted(os.listdir(resumed / "checkpoints")) == ["6", "9"]
  want = {e["step"]: e for e in read_jsonl(straight / "eval.jsonl")}
  got = {e["step"]: e for e in read_jsonl(resumed / "eval.jsonl")}
  assert got[9] == want[9] and got[3] == want[3]
  assert {k: v for k, v in got[6].items() if not k.startswith("test_")} == want[6]
  loss = lambda d: [r["loss"] for r in read_jsonl(d / "train.jsonl") if r["step"] > 6]
  assert loss(resumed) == loss(straight)


def test_the_epoch_covers_every_training_target(runs):
  data, _ = runs
  config = _config(data, 9)
  task = setup.task(config)
  train, _ = setup.sources(config, task, task.data_spec())
  assert train.batches_per_epoch == 4  # what the resume test above relies on
  targets = sum(int((train.batch(i)["targets"] > 0).sum()) for i in range(4))
  train_items = task.split.train_items
  assert targets == train.targets_per_epoch == sum(len(s) - 1 for s in train_items)


@pytest.mark.parametrize("key, value, match", [
    ("model.name", "ranker", r"config.model.name: 'ranker' can't train the sequential task; "
     r"use one of \('sasrec', 'hstu'\)"),
    ("data.path", "/no/such/ml-100k", r"config.data.path: '/no/such/ml-100k' does not exist"),
    ("task.ks", (0,), r"config.task.ks: \(0,\): give cut-offs >= 1"),
    ("model.dropout", 1.0, r"config.model.dropout: 1.0 must lie in \[0, 1\)"),
])
def test_bad_config_fails_before_the_workdir_naming_the_key(runs, tmp_path, key, value, match):
  data, _ = runs
  config = _config(data, 9)
  *parents, leaf = key.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ConfigError, match=match):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_a_dense_trained_table_needs_no_row_rule():
  emb = ShardedEmbed(10, 4, rngs=nnx.Rngs(0))
  opt = optim.SparseAwareOptimizer(emb, optax.adam(0.1), None)
  assert opt.keys == () and opt.tables is optim.optimizer.no_tables
  with pytest.raises(ValueError, match="sparse=None trains every table densely; drop tables="):
    optim.SparseAwareOptimizer(emb, optax.adam(0.1), None, tables=lambda key, m: True)
