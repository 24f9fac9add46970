"""``benchmarks/collection_lookup.py``: every case and PyTorch worker takes a new batch each call.

The script times forward lookups; no time is asserted here.
"""

import numpy as np
import pytest

from tests import benchmark_scripts


def test_each_call_takes_the_next_batch_from_the_first_again_after_the_last():
  script = benchmark_scripts.load("collection_lookup")
  seen = []
  call, args = script.cycling(lambda first, batch: seen.append((first, batch)), "state", "abc")
  assert args == ()
  for _ in range(5):
    call()
  assert seen == [("state", b) for b in "abcab"]


def test_the_workers_get_every_batch_and_how_many(monkeypatch, tmp_path):
  script = benchmark_scripts.load("collection_lookup")
  tables, features = script.specs(0.001)
  batches = [script.make_ids(tables, features, 8, seed=seed) for seed in range(3)]
  assert not np.array_equal(batches[0]["C2"], batches[1]["C2"])   # each its own draw
  monkeypatch.setattr(script, "missing_note", lambda python: None)
  monkeypatch.setattr(script, "start_or_note", lambda col, cmd, env, notes: (None, {}))
  args = type("Args", (), {"peer_python": "python", "fbgemm": True, "torch_threads": 2})()
  logical = {t.name: np.zeros((t.num_embeddings, t.features), np.float32) for t in tables}
  script.start_peers(args, str(tmp_path), features, logical, batches, want={})
  data = np.load(tmp_path / "ids.npz")
  assert int(data["batches"]) == 3
  for f in features:
    np.testing.assert_array_equal(data[f"ids_{f.name}"], np.stack([b[f.name] for b in batches]))


@pytest.mark.slow
def test_a_smoke_run_cycles_through_its_batches(tmp_path):
  script = benchmark_scripts.load("collection_lookup")
  path = tmp_path / "run.json"
  script.main(["--quick", "--peer-python", str(tmp_path / "no-peers"), "--json", str(path)])
  record = benchmark_scripts.read_record(path, ["collection_over_take", "dedup_over_collection"])
  assert f"{script.BATCHES} batches of ids, each call the next" in record["notes"]


def test_a_sample_is_several_calls_back_to_back_the_workers_too():
  # One call timed alone pays the machine's wake-up: a sample is --inner
  # calls (8 by default), a worker's as many of its forwards, ms per call.
  script = benchmark_scripts.load("collection_lookup")
  calls, requested = [], []

  class Worker:
    def run(self, steps):
      requested.append(steps)
      return {"seconds": 0.01 * steps}

  times = script.interleaved_with_workers({"jax": (lambda: calls.append(1), ())},
                                          {"torch": Worker()}, repeats=2, calls=8)
  assert len(calls) == 1 + 2 * 8   # a warm-up call, then two samples of 8
  assert requested == [8, 8] and times["torch"] == pytest.approx([10.0, 10.0])
  assert len(times["jax"]) == 2
