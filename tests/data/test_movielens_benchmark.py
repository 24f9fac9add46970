"""benchmarks/movielens.py's checks: the split comparison with RecBole's, the budget reading."""

import json

from tests import benchmark_scripts


def test_split_comparison_reads_raw_ids(tmp_path):
  bench = benchmark_scripts.load("movielens")
  (tmp_path / "ml.inter").write_text(
      "user_id:token\titem_id:token\ttimestamp:float\n"
      "a\tx\t1\na\ty\t2\na\tz\t3\nb\tz\t1\nb\tx\t5\nb\ty\t4\n")
  theirs = {"a": {"valid": "y", "test": "z"}, "b": {"valid": "y", "test": "x"}}
  (tmp_path / "split.json").write_text(json.dumps(theirs))
  assert bench.compare_splits(str(tmp_path), str(tmp_path / "split.json")) == (0, 2)
  theirs["b"]["test"] = "z"
  (tmp_path / "split.json").write_text(json.dumps(theirs))
  assert bench.compare_splits(str(tmp_path), str(tmp_path / "split.json")) == (1, 2)


def test_at_budget_takes_test_if_finished_else_last_validation():
  bench = benchmark_scripts.load("movielens")
  run = {"wall_s": 100.0, "test": {"ndcg@10": 0.5},
         "valid_curve": [{"t": 40.0, "ndcg@10": 0.2}, {"t": 90.0, "ndcg@10": 0.3}]}
  assert bench.at_budget(run, 120) == ("test, finished", 0.5)
  assert bench.at_budget(run, 60) == ("validation at 40 s", 0.2)
  assert bench.at_budget(run, 10)[0] == "nothing evaluated yet"
