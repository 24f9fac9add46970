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
  assert script.main(["--smoke", "--repeats", "1"]) == 0
  assert "check: ok" in capsys.readouterr().out
