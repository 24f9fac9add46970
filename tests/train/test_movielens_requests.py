"""The two towers and the ranker trained on a tiny ML-100K-format file (``configs/movielens.py``).

One smoke run of each (6 steps: evals at 3 and 6, the test set at 6), on the
file the sequential task's tests write.
"""

import numpy as np
import pytest

from configs import movielens
from embedlib.training import events, train_lib
from embedlib.training.tasks import ConfigError
from embedlib.training.writers import read_jsonl
from tests.train.test_sequential import write_ml100k

METRICS = {
    "two_tower": {f"{m}@{k}" for m in ("hr", "ndcg", "mrr") for k in (10, 20)},
    "ranker": {"auc/rated", "auc/liked", "auc_mean", "ndcg@10"},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return write_ml100k(tmp_path_factory.mktemp("data") / "ml-100k")


def _config(model, path):
  config = movielens.get_config(f"smoke,{model}")
  config.data.path = str(path)
  return config


@pytest.fixture(scope="module", params=sorted(METRICS))
def run(request, data, tmp_path_factory):
  workdir = tmp_path_factory.mktemp(request.param)
  train_lib.train_and_evaluate(_config(request.param, data), str(workdir))
  return request.param, workdir


def test_validation_at_each_eval_and_test_at_the_end(run):
  model, workdir = run
  metrics = METRICS[model]
  evals = read_jsonl(workdir / "eval.jsonl")
  assert [e["step"] for e in evals] == [3, 6]
  assert set(evals[0]) == metrics | {"step"}
  assert set(evals[-1]) == metrics | {f"test_{k}" for k in metrics} | {"step"}
  for e in evals:
    for k in e.keys() - {"step"}:
      assert 0.0 <= e[k] <= 1.0, k
  if model == "two_tower":  # 60 movies, 20 ranked: a hit is near certain
    assert evals[-1]["ndcg@10"] <= evals[-1]["hr@10"] <= evals[-1]["hr@20"]
    assert evals[-1]["test_hr@20"] > 0
  else:  # the held-out movie among 10 unrated ones: NDCG@10 is never 0 over 40 users
    assert evals[-1]["test_ndcg@10"] > 0
  tags = set(events.read_scalars(str(workdir / "tensorboard" / "eval")))
  assert tags == set(evals[-1]) - {"step"}
  train = read_jsonl(workdir / "train.jsonl")
  assert [r["step"] for r in train] == [2, 4, 6]
  assert all(np.isfinite(r["loss"]) for r in train)


@pytest.mark.parametrize("model, key, value, match", [
    ("ranker", "data.eval_candidates", 1, r"config.data.eval_candidates: give at least 2"),
    ("ranker", "data.actions", ("click",), r"config.data.actions: \('click',\): MovieLens "
     r"requests' actions are \('rated', 'liked'\)"),
    ("two_tower", "data.path", "/no/such/ml-100k",
     r"config.data.path: '/no/such/ml-100k' does not exist"),
    ("two_tower", "task.ks", (0,), r"config.task.ks: \(0,\): give cut-offs >= 1"),
])
def test_bad_config_fails_before_the_workdir_naming_the_key(data, tmp_path, model, key, value,
                                                            match):
  config = _config(model, data)
  group, leaf = key.split(".")
  config[group][leaf] = value
  with pytest.raises(ConfigError, match=match):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
