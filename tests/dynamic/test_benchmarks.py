"""Smoke runs of the dynamic tables' benchmark scripts: their checks, not their times."""

import re

import numpy as np
import pytest

from tests import benchmark_scripts


@pytest.mark.slow
def test_dynamic_quality_smoke_check_passes(capsys, tmp_path):
  script = benchmark_scripts.load("dynamic_quality")
  path = tmp_path / "run.json"
  assert script.main(["--smoke", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "holds every training id in its own row: True" in out
  assert "check: ok" in out
  record = benchmark_scripts.read_record(path, ["lru_minus_hashed_same_memory"])
  assert "planted oracle" in {c["name"] for c in record["cases"]}


def test_dynamic_quality_hashing_maps_ids_into_the_rows():
  script = benchmark_scripts.load("dynamic_quality")
  ids = np.array([(3 << 32) | 5, (3 << 32) | 5, 2**64 - 1, 7], np.uint64)
  rows = script.hashed(ids, 10)
  assert rows[0] == rows[1] and rows[2] == -1
  assert 0 <= rows[0] < 10 and 0 <= rows[3] < 10


def test_dynamic_quality_reads_the_columns_a_line_by_line_parse_reads(tmp_path):
  script = benchmark_scripts.load("dynamic_quality")
  path = tmp_path / "day.tsv"
  script.criteo_synth.CriteoSynth(seed=3, vocab_scale=0.5).write(path, 300)
  labels, dense, ids = script.read(path, 299, chunk_bytes=5_000)   # several chunks
  for i, line in enumerate(path.read_text().splitlines()[:299]):
    cols = line.split("\t")
    assert labels[i] == int(cols[0])
    np.testing.assert_array_equal(
        dense[i], np.float32([np.log1p(max(int(c), 0)) if c else 0.0 for c in cols[1:14]]))
    assert ids[i].tolist() == [(f << 32) | int(cols[14 + f], 16) if cols[14 + f] else 2**64 - 1
                               for f in script.SIGNAL]
  assert (ids == 2**64 - 1).any() and (dense == 0).any()      # empty fields were met
  with pytest.raises(ValueError, match="fewer than the 301"):
    script.read(path, 301)
  path.write_text("1\t2\tx\n")
  with pytest.raises(ValueError, match="40 tab-separated fields"):
    script.read(path, 1)


def test_dynamic_lookup_smoke_checks_the_map_against_the_reference(capsys, tmp_path):
  script = benchmark_scripts.load("dynamic_lookup")
  path = tmp_path / "run.json"
  assert script.main(["--smoke", "--repeats", "1", "--no-peers", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "check: ok" in out
  # Batches 0-2 warm the map, the next `filled` fill the table (every row resident:
  # the timed steps evict), the next warms the jitted step, then the round's 8 untimed
  # steps and its 8 timed ones, each on a new batch: the sample is --inner's.
  filled = int(re.search(r"filled: every row resident after (\d+) more steps", out).group(1))
  assert filled > 0
  last = 3 + filled + 16
  assert f"rows shared by distinct ids, batch {last}: embedlib 0 (0 ids;" in out
  assert "'occupancy': 1.0" in out and "'evicted': 0" not in out
  record = benchmark_scripts.read_record(path, ["dynamic_over_fixed", "dynamic_eval_over_fixed"])
  assert record["smoke"] and "vs_torchrec_mch" not in record["ratios"]
  assert "TorchRec columns left out (--no-peers)." in record["notes"]


def test_dynamic_lookup_parts_times_each_piece_of_the_step(capsys):
  script = benchmark_scripts.load("dynamic_lookup")
  assert script.main(["--smoke", "--parts", "--repeats", "1", "--no-peers", "--no-fill"]) == 0
  out = capsys.readouterr().out
  for piece in ("map step (step.admit_step; C++ kernel on CPU)", "eval lookup",
                "with HashedUniform (the default)", "and place them (mapping._place_rows)",
                "map step, marks and draws (mapping._step_and_place)"):
    assert piece in out


def test_dynamic_lookup_counts_rows_shared_by_distinct_ids():
  script = benchmark_scripts.load("dynamic_lookup")
  raw = np.array([5, 5, 6, 7, 8, 9], np.uint64)
  rows = np.array([0, 0, 0, 1, -1, -1])      # 5 and 6 share row 0; -1 is no row
  assert script.shared_rows(raw, rows) == (1, 2)


@pytest.mark.slow
def test_dynamic_memory_smoke_reports_the_ratio(capsys, tmp_path):
  script = benchmark_scripts.load("dynamic_memory")
  path = tmp_path / "run.json"
  assert script.main(["--quick", "--json", str(path)]) == 0
  assert "(peak - constant) / state =" in capsys.readouterr().out
  record = benchmark_scripts.read_record(path, ["dynamic_peak_over_state"])
  assert {c["unit"] for c in record["cases"]} == {"MiB"}
