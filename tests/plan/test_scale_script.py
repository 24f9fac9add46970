"""``benchmarks/scale.py`` checks its three targets on the rows it measured.

The measurement itself (one subprocess per device count, minutes each) is
run by hand; here its report is fed rows that meet each target and rows
that miss it by a little, and must say which.
"""

import pytest

from tests import benchmark_scripts

NEEDED = 1000


def rows(devices=64, routed=1400, vocab=20_000, auto=2500):
  out = []
  for workload, owner in (("sequence", "routed"), ("criteo", "stacked")):
    for layout, moved in (("vocab", vocab), (owner, routed), ("hidden", 3000), ("auto", auto)):
      out.append(dict(workload=workload, devices=devices, layout=layout, moved=moved,
                      planned=moved, needed=NEEDED, lookup_ms=[1.0, 1.0, 1.0], step_ms=[2.0, 2.0, 2.0]))
  return out


@pytest.fixture(scope="module")
def scale():
  return benchmark_scripts.load("scale")


def test_rows_meeting_every_target_pass(scale, capsys):
  assert scale.report(rows()) == []
  out = capsys.readouterr().out
  assert "share this machine's CPU cores" in out
  targets = [line for line in out.splitlines() if line.startswith("target:")]
  assert len(targets) == 2 * 3 and all(line.endswith(": ok") for line in targets)


@pytest.mark.parametrize("kw, failed", [
    (dict(routed=1501), ["criteo-64-ratio", "sequence-64-ratio"]),
    (dict(vocab=13_999), ["criteo-64-vocab", "sequence-64-vocab"]),
    (dict(auto=2801), ["criteo-64-auto", "sequence-64-auto"]),
])
def test_a_missed_target_is_named(scale, kw, failed, capsys):
  assert sorted(scale.report(rows(**kw))) == failed
  assert "FAILED" in capsys.readouterr().out


def test_the_vocab_target_applies_at_64_devices_only(scale):
  assert scale.report(rows(devices=32, vocab=5000)) == []


def node_rows(node=240):
  out = []
  for workload in ("uniform", "zipf"):
    for route, inter in (("flat", 1000), ("device dedup", 500), ("node", node)):
      out.append(dict(workload=workload, devices=64, route=route, capacity=10,
                      node_capacity=None if route == "flat" else 20, moved=2000, inter=inter,
                      planned_inter=inter if route == "node" else None, step_moved=4000,
                      step_inter=2 * inter))
  return out


def test_the_node_target_reads_the_zipf_rows_at_64_devices(scale, capsys):
  assert scale.report_nodes(node_rows()) == []
  out = capsys.readouterr().out
  assert ("target: zipf, 64 devices, node / flat inter-node bytes per lookup = 0.240 "
          "(<= 0.25): ok") in out
  assert "not a target: uniform" in out
  assert scale.report_nodes(node_rows(node=251)) == ["zipf-64-nodes"]


def test_the_record_keeps_each_rows_bytes_times_and_moved_over_needed(scale, tmp_path):
  timing = benchmark_scripts.load("timing")
  run = timing.Run("scale", [], probe_bytes=1 << 16)
  scale.record_rows(run, rows() + [dict(workload="sequence", devices=64, route="node",
                                        needed=NEEDED, moved=500, inter=100, skipped="why")])
  run.finish(str(tmp_path / "run.json"))
  record = benchmark_scripts.read_record(tmp_path / "run.json")
  assert record["ratios"]["moved_over_needed_sequence_64dev_routed"] == pytest.approx(1.4)
  assert record["ratios"]["moved_over_needed_sequence_64dev_node"] == pytest.approx(0.5)
  cases = {c["name"]: c for c in record["cases"]}
  assert cases["criteo_64dev_stacked: step_ms"]["median"] == 2.0
  assert cases["sequence_64dev_node: inter"]["unit"] == "bytes"
  assert "sequence_64dev_node: why" in record["notes"]
