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


def test_targets_read_the_default_runs_and_report_the_plain_ones(capsys):
  bench = benchmark_scripts.load("movielens")

  def runs_of(ndcg, s_per_epoch=10.0):
    return [{"seed": s, "test": {"hit@10": 2 * ndcg, "ndcg@10": ndcg, "mrr@10": ndcg / 2},
             "epochs": 30.0, "wall_s": 300.0, "s_per_epoch": s_per_epoch, "peak_rss_mib": 700.0,
             "valid_curve": [{"t": 100.0, "epochs": 10.0, "ndcg@10": ndcg}]}
            for s in (1, 2)]
  runs = {"embedlib sasrec": runs_of(0.10), "embedlib hstu": runs_of(0.11),
          "embedlib sasrec-plain": runs_of(0.06), "RecBole BPR": runs_of(0.06),
          "RecBole SASRec": runs_of(0.02, s_per_epoch=700.0)}
  summary = {name: bench.summarize(name, rs) for name, rs in runs.items()}
  bench.print_targets(summary, runs, budget=900.0)
  out = capsys.readouterr().out
  assert "[met] embedlib SASRec test NDCG@10 >= 1.25 x RecBole BPR's: 1.67x" in out
  assert "[met] embedlib HSTU above embedlib SASRec" in out
  assert "[met] embedlib SASRec epoch >= 20x faster than RecBole SASRec's: 70x" in out
  assert "embedlib sasrec-plain 0.0600 (1.00x)" in out
  assert "NOT met" not in out
