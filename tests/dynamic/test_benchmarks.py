"""Smoke runs of the dynamic tables' benchmark scripts: their checks, not their times."""

import numpy as np
import pytest

from tests import benchmark_scripts


@pytest.mark.slow
def test_dynamic_quality_smoke_check_passes(capsys):
  script = benchmark_scripts.load("dynamic_quality")
  assert script.main(["--smoke"]) == 0
  out = capsys.readouterr().out
  assert "holds every training id in its own row: True" in out
  assert "check: ok" in out


def test_dynamic_quality_hashing_maps_ids_into_the_rows():
  script = benchmark_scripts.load("dynamic_quality")
  ids = np.array([(3 << 32) | 5, (3 << 32) | 5, 2**64 - 1, 7], np.uint64)
  rows = script.hashed(ids, 10)
  assert rows[0] == rows[1] and rows[2] == -1
  assert 0 <= rows[0] < 10 and 0 <= rows[3] < 10


def test_dynamic_lookup_smoke_checks_the_map_against_the_reference(capsys):
  script = benchmark_scripts.load("dynamic_lookup")
  assert script.main(["--smoke", "--repeats", "1", "--no-peers"]) == 0
  out = capsys.readouterr().out
  assert "check: ok" in out
  assert "rows shared by distinct ids, batch 4: embedlib 0 (0 ids;" in out


def test_dynamic_lookup_counts_rows_shared_by_distinct_ids():
  script = benchmark_scripts.load("dynamic_lookup")
  raw = np.array([5, 5, 6, 7, 8, 9], np.uint64)
  rows = np.array([0, 0, 0, 1, -1, -1])      # 5 and 6 share row 0; -1 is no row
  assert script.shared_rows(raw, rows) == (1, 2)


@pytest.mark.slow
def test_dynamic_memory_smoke_reports_the_ratio(capsys):
  script = benchmark_scripts.load("dynamic_memory")
  assert script.main(["--quick"]) == 0
  assert "(peak - constant) / state =" in capsys.readouterr().out
