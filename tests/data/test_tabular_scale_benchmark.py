"""benchmarks/tabular_scale.py: its log, its file subsets, its ratios; a quick run end to end (slow).

No time is asserted: the quick run checks that every case ran and that
every memory run read the rows its files hold.
"""

import json
import os

import pyarrow.parquet as pq
import pytest

from tests import benchmark_scripts


def test_the_log_is_written_once_and_read_in_subsets(tmp_path):
  bench = benchmark_scripts.load("tabular_scale")
  folder = bench.ensure_log(str(tmp_path), rows=3_000, files=3, row_group=500)
  paths = bench.parquet_files(folder)
  assert [os.path.basename(p) for p in paths] == [
      "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
  assert sum(pq.ParquetFile(p).metadata.num_rows for p in paths) == 3_000
  stamp = os.path.getmtime(paths[0])
  assert bench.ensure_log(str(tmp_path), rows=3_000, files=3, row_group=500) == folder
  assert os.path.getmtime(paths[0]) == stamp  # reused, not written again
  sizes = bench.decoded_sizes(folder)
  assert (sizes["files"], sizes["rows"], sizes["row_groups"]) == (3, 3_000, 6)
  assert 0 < sizes["row_group_mib"] < sizes["file_mib"]
  assert (sizes["file_rows"], sizes["row_group_rows"]) == (1_000, 500)
  two = bench.first_files(folder, 2, str(tmp_path / "links"))
  assert sorted(os.listdir(two)) == ["part-00000.parquet", "part-00001.parquet"]
  assert os.path.realpath(os.path.join(two, "part-00001.parquet")) == paths[1]


def test_rate_ratios_are_of_medians():
  bench = benchmark_scripts.load("tabular_scale")
  rates = {"tabular, in-process": {"ex_s": [90.0, 100.0, 300.0], "cpu_all": [2.0, 2.0, 9.0]},
           "tabular, 2 workers": {"ex_s": [150.0, 200.0, 250.0], "cpu_all": [2.5, 2.5, 2.5]},
           bench.CRITEO: {"ex_s": [1000.0, 1000.0, 1000.0], "cpu_all": [0.1, 0.1, 0.1]},
           bench.STEP: {"ex_s": [40.0, 50.0, 60.0], "cpu_all": [5.0, 5.0, 5.0]}}
  named = bench.rate_ratios(rates)
  assert named[f"tabular, in-process / {bench.CRITEO}"] == pytest.approx(0.1)
  assert named[f"tabular, 2 workers / {bench.STEP}"] == pytest.approx(4.0)
  assert named["tabular, 2 workers / tabular, in-process"] == pytest.approx(2.0)
  assert named[f"CPU per example: {bench.STEP} / tabular, in-process"] == pytest.approx(2.5)
  assert named[f"CPU per example: {bench.STEP} / tabular, 2 workers"] == pytest.approx(2.0)


@pytest.mark.slow
def test_quick_run_measures_every_case_and_file_count(tmp_path, capsys):
  bench = benchmark_scripts.load("tabular_scale")
  results = bench.main(["--quick", "--data-dir", str(tmp_path), "--workers", "0,1",
                        "--out", str(tmp_path / "r.json"), "--json", str(tmp_path / "record.json")])
  assert [r["files"] for r in results["memory"]] == [1, 3]
  for run in results["memory"]:
    assert run["read_examples"] <= run["train_rows"]
    assert run["peak_mib"] >= run["rss_imports_mib"] > 0
  assert set(results["cases"]) == {"tabular, in-process", "tabular, 1 worker", bench.CRITEO,
                                   bench.STEP}
  assert all(c["ex_s"]["min"] > 0 for c in results["cases"].values())
  assert f"tabular, 1 worker / {bench.STEP}" in results["ratios"]
  assert max(results["peak_rss_mib"]["tabular, 1 worker"]) > 0  # grain's worker (and helpers)
  assert "statistics pass over all 3 files" in capsys.readouterr().out
  with open(tmp_path / "record.json") as f:  # the record every benchmark writes (timing.Run)
    record = json.load(f)
  assert {"peak RSS, 1 files", "peak RSS, 3 files", "statistics pass",
          f"{bench.STEP}"} <= {c["name"] for c in record["cases"]}
  assert record["ratios"] == pytest.approx(results["ratios"])
