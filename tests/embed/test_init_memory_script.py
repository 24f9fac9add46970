"""``benchmarks/init_memory.py`` checks every build against the plain init before printing.

The quick run (1 MiB tables, fresh worker processes on 8 simulated CPU
devices, this checkout's embedlib) passes its check and prints the
ShardedEmbed line; a build from another seed, or one row entry an ulp off,
fails the check. No memory figure is asserted.
"""

import copy
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from tests import benchmark_scripts

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "init_memory.py"


def import_script():
  saved = list(sys.path)
  try:
    spec = importlib.util.spec_from_file_location("init_memory_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = saved
  return module


# Three fresh worker processes, as the other benchmark scripts' check-then-time runs: -m slow.
@pytest.mark.slow
def test_quick_run_checks_then_prints(monkeypatch, capsys, tmp_path):
  script = import_script()
  seen = []
  real = script._run
  monkeypatch.setattr(script, "_run", lambda argv: seen.append(real(argv)) or seen[-1])
  path = tmp_path / "run.json"
  assert script.main(["--quick", "--layouts", "vocab", "--json", str(path)]) == 0
  benchmark_scripts.read_record(path, ["sharded_over_plain_1MiB_vocab", "worst_sharded_over_plain"])
  out = capsys.readouterr().out
  assert "ShardedEmbed / plain, worst median" in out and "differs" not in out
  plain, sharded, collection = seen
  assert plain["rows"] == plain["eager_rows"]  # the eager nnx.Embed formula
  assert sharded["rows"] == plain["rows"] and collection["rows"] == plain["rows"]
  assert all(r["peak"] >= r["baseline"] > 0 for r in seen)

  results = {(1, "vocab", c): [r] for c, r in zip(script.CASES, seen)}
  off = copy.deepcopy(results)
  row = off[(1, "vocab", "ShardedEmbed")][0]["rows"][1]
  row[5] = float(np.nextafter(np.float32(row[5]), np.float32(np.inf)))
  assert script.agree(results)
  assert not script.agree(off)
  assert "ShardedEmbed (1 GiB, vocab) differs" in capsys.readouterr().out


@pytest.mark.slow  # the verdict itself (agree) is checked in the quick run above
def test_a_build_from_another_seed_fails_the_run(capsys):
  script = import_script()
  assert script.main(["--quick", "--layouts", "hidden", "--wrong-seed", "EmbeddingCollection"]) == 1
  out = capsys.readouterr().out
  assert "EmbeddingCollection (1 MiB, hidden) differs from the plain init" in out
  assert "worst median" not in out
