"""The benchmarks' records and the table they feed (``benchmarks/timing.py``, ``results_table.py``).

``benchmarks/README.md`` opens with a table generated from the quiet runs kept
in ``benchmarks/results/``: it must be what the generator prints now, so it
cannot go stale. The generator must take each headline ratio from its latest
quiet run, skip loaded, smoke and uncommitted runs, and say so where there is
none. Tiny and timing-free: no benchmark runs here, and no time is asserted.
"""

import argparse
import json

import pytest

from tests import benchmark_scripts

timing = benchmark_scripts.load("timing")
results_table = benchmark_scripts.load("results_table")


def record(benchmark="sparse_step", command="", date="2026-12-06T10:00:00Z", ratios=None,
           load=0.1, steal=0.5, gbps=(30.0, 31.0, 29.5), smoke=False, dirty=False,
           commit="abc1234"):
  """A record as ``Run.record`` writes it, quiet unless told otherwise."""
  out = {
      "benchmark": benchmark, "commit": commit, "dirty": dirty, "date": date,
      "command": f"python3 benchmarks/{benchmark}.py {command}".strip(), "smoke": smoke,
      "machine": {"cores": 2, "load_before": load, "load_after": 2.0, "steal_pct": steal,
                  "copy_gbps": list(gbps), "copy_spread": timing.spread(list(gbps)),
                  "probe_mib": 512.0},
      "cases": [{"name": "a", "min": 1.0, "median": 2.0, "max": 3.0, "unit": "ms"}],
      "ratios": ratios if ratios is not None else {"vs_fbgemm_1M_x_64": 1.5},
      "notes": [],
  }
  out["file"] = f"{benchmark}_{date}.json"
  return out


def row(block, ratio):
  return next(line for line in block.splitlines() if line.startswith(f"| `{ratio}` |"))


def test_readme_table_is_what_the_kept_results_give():
  text = results_table.README.read_text()
  assert text.startswith("# Benchmarks\n\n" + results_table.BEGIN), (
      "benchmarks/README.md must open with the generated table")
  assert results_table.block_of(text) == results_table.render(results_table.load_results()), (
      "benchmarks/README.md's table is stale: run `python3 benchmarks/results_table.py`")


def test_every_kept_result_is_quiet_full_size_and_committed():
  for r in results_table.load_results():
    assert not results_table.keep_problems(r), (r["file"], results_table.keep_problems(r))


def test_without_a_quiet_run_each_row_says_so():
  block = results_table.render([])
  for h in results_table.HEADLINES:
    assert "no quiet run yet" in row(block, h.ratio), h.ratio
  assert row(block, "vs_torchrec_fused").endswith(
      "`python3 benchmarks/train_dlrm.py --full --no-8dev --json FILE` |")


def test_the_latest_quiet_run_stands_and_loaded_smoke_or_dirty_runs_do_not():
  older = record(date="2026-12-06T10:00:00Z", ratios={"vs_fbgemm_1M_x_64": 1.25})
  newer = record(date="2026-12-07T10:00:00Z", ratios={"vs_fbgemm_1M_x_64": 1.50})
  later = [record(date="2026-12-08T10:00:00Z", ratios={"vs_fbgemm_1M_x_64": 9.0}, **bad)
           for bad in ({"load": 1.9}, {"steal": 5.0}, {"gbps": (30.0, 20.0)}, {"smoke": True},
                       {"dirty": True}, {"gbps": (30.0,)})]
  line = row(results_table.render([older, newer] + later), "vs_fbgemm_1M_x_64")
  assert "**1.50**" in line and "`abc1234`, 2026-12-07" in line and "9.00" not in line
  # A ratio no run has keeps saying so beside one that has a run.
  assert "no quiet run yet" in row(results_table.render([newer]), "vs_fbgemm_10M_x_32")


def test_a_row_takes_only_runs_of_its_variant():
  standard = record("train_dlrm", "--no-8dev", ratios={"vs_torchrec_fused": 1.6})
  full = record("train_dlrm", "--full --no-8dev", date="2026-12-05T00:00:00Z",
                ratios={"vs_torchrec_fused": 1.7})
  zeros = record("dynamic_lookup", "--zeros-init", ratios={"dynamic_over_fixed": 1.2})
  block = results_table.render([standard, full, zeros])
  assert "**1.70**" in row(block, "vs_torchrec_fused")
  assert "no quiet run yet" in row(block, "dynamic_over_fixed")


def test_quiet_is_load_steal_and_probe_spread():
  assert timing.quiet_reasons(record()) == []
  reasons = timing.quiet_reasons(record(load=0.6, steal=2.5, gbps=(10.0, 12.5)))
  assert [r.split(" ")[0] for r in reasons] == ["load", "steal", "copy"], reasons
  assert "0.50 (0.25 x 2 cores)" in reasons[0] and "25% > 20%" in reasons[2]
  assert timing.spread([10.0, 12.0]) == pytest.approx(0.2) and timing.spread([1.0]) is None
  # From ten probes on, one outlier at each end is left out (the ratios are
  # medians); a machine that changed over several rounds is still noisy.
  steady = [16.0] * 9 + [17.0, 17.5]
  assert timing.spread(steady + [12.0, 21.0]) == pytest.approx(17.5 / 16.0 - 1)
  assert timing.spread(steady + [12.0, 12.0, 12.0]) == pytest.approx(17.0 / 12.0 - 1)


def test_keep_refuses_a_loaded_run_and_names_a_quiet_one_by_benchmark_date_commit(tmp_path):
  loaded = tmp_path / "loaded.json"
  loaded.write_text(json.dumps(record(load=3.0)))
  with pytest.raises(SystemExit, match="not kept: load average 3.00 at the start"):
    results_table.keep(str(loaded), tmp_path / "results")
  quiet = tmp_path / "quiet.json"
  quiet.write_text(json.dumps(record(date="2026-12-06T10:20:30Z")))
  kept = results_table.keep(str(quiet), tmp_path / "results")
  assert kept.name == "sparse_step_20261206T102030_abc1234.json"
  assert [r["file"] for r in results_table.load_results(tmp_path / "results")] == [kept.name]


def test_a_run_writes_the_json_format_and_flags_a_noisy_probe(tmp_path, capsys):
  run = timing.Run("sparse_step", ["--quick", "--json", "x.json"], smoke=True,
                   probe_bytes=1 << 16)
  run.add_times({"ours": [1.0, 3.0, 2.0], "theirs": [4.0, 4.0]})
  run.ratio("vs_theirs", 2.0)
  run.copy_gbps[:] = [10.0, 15.0]   # the probes as if the machine's bandwidth moved
  out = run.finish(str(tmp_path / "run.json"))
  written = json.loads((tmp_path / "run.json").read_text())
  timing.check_record(written)
  assert written == json.loads(json.dumps(out))
  assert written["command"] == "python3 benchmarks/sparse_step.py --quick"
  assert written["cases"][0] == {"name": "ours", "min": 1.0, "median": 2.0, "max": 3.0,
                                 "unit": "ms", "n": 3}
  assert written["noisy"] and not written["quiet"] and written["smoke"]
  printed = capsys.readouterr().out
  assert "NOISY: the copy probe varied 50% between rounds" in printed
  assert "vs_theirs" in printed and "(noisy)" in printed
  with pytest.raises(ValueError, match="recorded twice"):
    run.add_case("ours", 1.0)
  with pytest.raises(ValueError, match="has no 'ratios'"):
    timing.check_record({k: v for k, v in written.items() if k != "ratios"})


def test_size_tags_name_the_headline_tables():
  assert [timing.size_tag(*s) for s in ((1_000_000, 64), (10_000_000, 32), (100_000, 64),
                                         (65_536, 16))] == [
      "1M_x_64", "10M_x_32", "100k_x_64", "65536_x_16"]


def test_every_benchmark_script_takes_json_and_keeps_a_run():
  """Each script with a command line (``main``) keeps a ``timing.Run`` and takes ``--json``."""
  scripts = sorted(p for p in benchmark_scripts.BENCHMARKS.glob("*.py")
                   # The generators of committed tables measure nothing.
                   if "def main(" in p.read_text() and p.stem not in ("results_table", "gpu_table"))
  assert len(scripts) >= 20, scripts
  lacking = [p.name for p in scripts
             if "add_json_argument(parser)" not in p.read_text()
             or f'Run("{p.stem}"' not in p.read_text()]
  assert not lacking, f"no --json (timing.add_json_argument, timing.Run) in: {lacking}"


def test_inner_is_calls_a_sample_and_refuses_fewer_than_one(capsys):
  parser = argparse.ArgumentParser()
  timing.add_inner_argument(parser, since="a date")
  assert parser.parse_args([]).inner == 8
  assert parser.parse_args(["--inner", "3"]).inner == 3
  timing.check_inner(parser, 1)
  with pytest.raises(SystemExit):
    timing.check_inner(parser, 0)
  assert "--inner 0: a sample makes at least one call; pass 1 or more" in capsys.readouterr().err
  calls = []
  times = timing.interleaved({"a": (lambda: calls.append(1), ())}, 2, calls=3)
  assert len(calls) == 1 + 2 * 3 and len(times["a"]) == 2
