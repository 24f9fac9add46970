"""benchmarks/tabular_movielens.py: RecBole gets embedlib's split row for row; the report's sums.

The split files are checked against what embedlib's own reader yields for
each part (the ids and the labels of every row, in order); the report
against runs made up here; and a smoke run end to end (slow: it trains).
No time is asserted.
"""

import json
import os

import numpy as np
import pytest

from embedlib import tabular
from tests import benchmark_scripts

GENRES = ("Action", "Comedy", "Drama", "Horror")


def write_recbole(folder, rows=600, users=30, items=40, seed=0) -> str:
  """A tiny dataset laid out as RecBole's ML-100K (``.inter``, ``.user``, ``.item``)."""
  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  base = os.path.join(folder, "tiny")
  with open(base + ".inter", "w") as f:
    f.write("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
    for r in range(rows):
      f.write(f"{rng.integers(1, users + 1)}\t{rng.integers(1, items + 1)}\t"
              f"{rng.integers(1, 6)}\t{880000000 + r}\n")
  with open(base + ".user", "w") as f:
    f.write("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n")
    for u in range(1, users + 1):
      f.write(f"{u}\t{20 + u % 30}\t{'MF'[u % 2]}\tjob{u % 5}\t{10000 + u}\n")
  with open(base + ".item", "w") as f:
    f.write("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n")
    for i in range(1, items + 1):
      f.write(f"{i}\tTitle {i} Part\t{1980 + i % 15}\t{GENRES[i % 4]} {GENRES[(i + 1) % 4]}\n")
  return base + ".inter"


def _part_rows(path, part, split):
  """``(user, item, click)`` of every row embedlib's reader yields for ``part``, in order,
  the ids as raw values (each vocabulary row read back)."""
  data = tabular.prepare(path, tabular.Hints(labels=("rating",), ignore=(
      "age", "gender", "occupation", "zip_code", "movie_title", "release_year", "class")),
      split=split, label_threshold=4.0)
  raw = {name: ["<unseen>"] + [str(v) for v in data.featurizer.vocabs[name].to_pylist()]
         for name in ("user_id", "item_id")}
  out = []
  for batch in data.source(part, batch_size=1, num_epochs=1):
    out.append((raw["user_id"][int(batch["sparse"]["user_id"][0])],
                raw["item_id"][int(batch["sparse"]["item_id"][0])], float(batch["label"][0])))
  return out


def test_the_recbole_files_hold_embedlibs_parts_row_for_row(tmp_path):
  bench = benchmark_scripts.load("tabular_movielens")
  inter = write_recbole(str(tmp_path / "data"))
  split = bench.split_config()
  counts = bench.write_split(inter, str(tmp_path / "out"), name="tiny-split", split=split)
  folder = tmp_path / "out" / "tiny-split"
  assert sorted(os.listdir(folder)) == ["tiny-split.item", "tiny-split.test.inter",
                                        "tiny-split.train.inter", "tiny-split.user",
                                        "tiny-split.valid.inter"]
  assert sum(c["rows"] for c in counts.values()) == 600
  assert 0 < counts["valid"]["rows"] < counts["train"]["rows"]
  train_users = set()
  for ours, theirs in bench.PARTS:
    lines = (folder / f"tiny-split.{theirs}.inter").read_text().splitlines()
    assert lines[0] == "user_id:token\titem_id:token\trating:float\ttimestamp:float"
    rows = [line.split("\t") for line in lines[1:]]
    assert counts[theirs] == {"rows": len(rows),
                              "clicks": sum(float(r[2]) >= 4 for r in rows)}
    if ours == "train":
      train_users = {r[0] for r in rows}
    # A user or item the training rows never held reads as the unseen row in embedlib.
    want = [(r[0] if r[0] in train_users else "<unseen>", r[1], float(float(r[2]) >= 4))
            for r in rows]
    got = _part_rows(inter, ours, split)
    assert [(u, c) for u, _, c in got] == [(u, c) for u, _, c in want]


def _runs(auc, seeds=(0, 1), **extra):
  return [{"seed": s, "test": {"auc": auc + 0.001 * s, "logloss": 0.5}, "wall_s": 60.0 + s,
           "process_s": 70.0, "load_before": 2.0, "load_after": 2.5, **extra} for s in seeds]


def test_summary_ratios_and_targets(capsys):
  bench = benchmark_scripts.load("tabular_movielens")
  parts = {"train": {"rows": 80, "clicks": 40}, "valid": {"rows": 10, "clicks": 5},
           "test": {"rows": 10, "clicks": 6}}
  runs = {
      "embedlib dlrm, side columns": _runs(0.790, train_rows=80),
      "embedlib dlrm, ids only": _runs(0.775, train_rows=80),
      "embedlib dcn_v2, side columns": _runs(0.785, train_rows=80),
      "embedlib dcn_v2, ids only": _runs(0.780, train_rows=80),
      "embedlib two_tower, side columns": [
          {"seed": 0, "test": {"recall@100": 0.30}, "wall_s": 30.0, "train_rows": 80}],
      "embedlib two_tower, ids only": [
          {"seed": 0, "test": {"recall@100": 0.25}, "wall_s": 30.0, "train_rows": 80}],
      "RecBole DeepFM": _runs(0.780, parts=parts),
      "RecBole FM": _runs(0.800, parts={**parts, "test": {"rows": 9, "clicks": 6}}),
  }
  cases = bench.summarize(runs, parts)
  assert cases["embedlib dlrm, side columns"]["auc"]["median"] == pytest.approx(0.7905)
  assert cases["embedlib dlrm, side columns"]["wall_s"]["max"] == 61.0
  assert cases["RecBole DeepFM"]["split_ok"] and not cases["RecBole FM"]["split_ok"]
  named = bench.ratios(cases)
  # FM's split differs: the best RecBole model is DeepFM's, not FM's higher AUC.
  assert named["best RecBole"] == "RecBole DeepFM"
  assert named["best embedlib"] == "embedlib dlrm, side columns"
  assert named["best embedlib - best RecBole, test AUC"] == pytest.approx(0.010)
  assert named["dlrm: side columns - ids only, test AUC"] == pytest.approx(0.015)
  assert named["dcn_v2: side columns - ids only, test AUC"] == pytest.approx(0.005)
  assert named["two_tower: side columns / ids only, test recall@100"] == pytest.approx(1.2)
  bench.print_table(cases)
  bench.print_targets(named)
  out = capsys.readouterr().out
  assert "[met] dlrm side columns worth >= +0.01 test AUC over ids only: +0.0150" in out
  assert "[NOT met] dcn_v2 side columns worth >= +0.01" in out
  assert "[met] test AUC above RecBole's best context-aware model" in out
  assert "RecBole FM" in out and "(its split differs: left out)" in out


def test_order_interleaves_ours_and_theirs():
  bench = benchmark_scripts.load("tabular_movielens")
  assert bench.order(["a", "b", "c"], ["X"]) == [
      ("embedlib", "a"), ("recbole", "X"), ("embedlib", "b"), ("embedlib", "c")]


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path, capsys):
  bench = benchmark_scripts.load("tabular_movielens")
  inter = write_recbole(str(tmp_path / "data"), rows=1500)
  results = bench.main(["--data", inter, "--smoke", "--seeds", "0", "--recbole", "none",
                        "--cases", "dlrm,dlrm-ids,two_tower", "--out", str(tmp_path / "r.json"),
                        "--json", str(tmp_path / "record.json")])
  cases = results["cases"]
  assert set(cases) == {"embedlib dlrm, side columns", "embedlib dlrm, ids only",
                        "embedlib two_tower, side columns"}
  assert all(c["split_ok"] for c in cases.values())
  assert 0.0 <= cases["embedlib dlrm, ids only"]["auc"]["median"] <= 1.0
  assert 0.0 <= cases["embedlib two_tower, side columns"]["recall@100"]["median"] <= 1.0
  assert "dlrm: side columns - ids only, test AUC" in results["ratios"]
  out = capsys.readouterr().out
  assert "Targets (issue 52):" in out
  assert os.path.exists(tmp_path / "r.json")
  with open(tmp_path / "record.json") as f:  # the record every benchmark writes (timing.Run)
    record = json.load(f)
  assert record["benchmark"] == "tabular_movielens" and record["smoke"]
  names = {c["name"] for c in record["cases"]}
  assert {"embedlib dlrm, ids only: test auc", "embedlib dlrm, ids only: wall"} <= names
  assert record["ratios"]["dlrm: side columns - ids only, test AUC"] == pytest.approx(
      results["ratios"]["dlrm: side columns - ids only, test AUC"])


def test_report_joins_the_runs_of_several_out_files(tmp_path, capsys):
  import json

  bench = benchmark_scripts.load("tabular_movielens")
  parts = {"train": {"rows": 80, "clicks": 40}, "valid": {"rows": 10, "clicks": 5},
           "test": {"rows": 10, "clicks": 6}}
  paths = []
  for seed, auc in ((0, 0.78), (1, 0.79), (2, 0.77)):
    path = tmp_path / f"seed{seed}.json"
    path.write_text(json.dumps({
        "benchmark": "tabular_movielens", "data": "d", "split": parts, "notes": [],
        "overrides": [], "smoke": False, "seeds": [seed],
        "runs": {"embedlib dcn_v2, side columns": _runs(auc, seeds=(seed,), train_rows=80),
                 "RecBole FM": _runs(0.775, seeds=(seed,), parts=parts)}}))
    paths.append(str(path))
  results = bench.main(["--report", ",".join(paths), "--out", str(tmp_path / "all.json")])
  assert results["seeds"] == [0, 1, 2]
  dcn = results["cases"]["embedlib dcn_v2, side columns"]
  assert (dcn["auc"]["min"], dcn["auc"]["median"], dcn["auc"]["max"]) == (0.772, 0.78, 0.791)
  assert results["ratios"]["best embedlib - best RecBole, test AUC"] == pytest.approx(0.004)
  assert "[met] test AUC above RecBole's best" in capsys.readouterr().out
  other = json.loads((tmp_path / "seed0.json").read_text())
  other["split"]["test"]["rows"] = 11
  (tmp_path / "seed0.json").write_text(json.dumps(other))
  with pytest.raises(SystemExit, match="split differs"):
    bench.main(["--report", ",".join(paths)])
