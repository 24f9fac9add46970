"""The sparse-step benchmark (``benchmarks/sparse_step.py``): protocol and check.

Each case must run one untimed step right before each timed one, so that
what the previous case left behind (the dense step frees its temporaries
after its results are ready) is not charged to it. ``--check`` must pass on
both CPU update paths before anything is timed, and fail, with nothing
timed, against a wrong reference. The script runs in this process, on this
checkout's embedlib. No time is asserted.
"""

import functools

import numpy as np
import pytest

from embedlib.kernels import cpu_library
from embedlib.optim import fused_cpu
from tests import benchmark_scripts


def test_every_timed_call_follows_an_untimed_call_of_the_same_case():
  sparse_step = benchmark_scripts.load("sparse_step")
  calls = []

  def case(name):
    def run():
      calls.append(name)
      return float(len(calls))   # the call's position stands in for its ms
    return run

  times = sparse_step.settled_rounds({"a": case("a"), "b": case("b"), "c": case("c")}, 4)
  assert len(calls) == 3 * 4 * 2
  pairs = [calls[i:i + 2] for i in range(0, len(calls), 2)]
  assert all(first == second for first, second in pairs), pairs
  for name, recorded in times.items():
    # Only the second call of each pair is recorded: positions 2, 4, 6, ...
    assert len(recorded) == 4 and all(t % 2 == 0 for t in recorded), (name, recorded)
    assert all(calls[int(t) - 1] == name for t in recorded), (name, recorded)
  # Shuffled: the rounds do not all run in the same order.
  orders = [tuple(p[0] for p in pairs[r * 3:(r + 1) * 3]) for r in range(4)]
  assert len(set(orders)) > 1, orders


def recording_runs(sparse_step, monkeypatch):
  """Replaces the script's ``run`` (the timing of one table) by one that records its results."""
  runs = []
  real = sparse_step.run

  def run(vocab, width, n, repeats, *rest):
    runs.append(((vocab, width), real(vocab, width, n, repeats, *rest)))
    return runs[-1][1]

  monkeypatch.setattr(sparse_step, "run", run)
  return runs


QUICK = ["--check", "--quick", "--no-peers", "--repeats", "1", "--inner", "2"]


@pytest.mark.slow
def test_the_check_passes_then_every_case_is_timed(monkeypatch, tmp_path):
  sparse_step = benchmark_scripts.load("sparse_step")
  runs = recording_runs(sparse_step, monkeypatch)
  path = tmp_path / "run.json"
  assert sparse_step.main(QUICK + ["--json", str(path)]) == 0
  # The record names each table's distance from its copy; without the peers
  # it has no FBGEMM ratio, and says so.
  record = benchmark_scripts.read_record(path, ["copy_distance_100k_x_64", "copy_distance_1M_x_32"])
  assert not any(name.startswith("vs_fbgemm") for name in record["ratios"])
  assert "100k_x_64: no FBGEMM column, so no vs_fbgemm_100k_x_64" in record["notes"]
  # The sorted update (every other platform's) is timed beside the CPU's own.
  # The copies of the step's bytes and of 1 GiB: its bandwidth limit, in the same rounds.
  cases = {sparse_step.SPARSE, sparse_step.DENSE, sparse_step.SPARSE_SORTED,
           sparse_step.COPY, sparse_step.DRAM_COPY}
  if fused_cpu.enabled():
    cases.add(sparse_step.SPARSE_XLA)   # the XLA ops beside the fused CPU update
  if cpu_library.available():
    cases.add(sparse_step.ROWS_FLOOR)   # the distinct rows touched where they lie
    assert {"rows_floor_over_copy_1M_x_32", "rows_floor_distance_1M_x_32"} <= set(record["ratios"])
  bare = {sparse_step.BARE_PASSES, sparse_step.BARE_COPY} if cpu_library.available() else set()
  if bare:   # the same two passes in bare C++, 5 rounds of its own after the step's rounds
    assert {"bare_floor_over_copy_1M_x_32", "bare_copy_over_copy_1M_x_32"} <= set(record["ratios"])
  assert [size for size, _ in runs] == [(100_000, 64), (1_000_000, 32)]
  for _, times in runs:
    assert set(times) == cases | bare, times
    assert all(len(times[c]) == 1 and times[c][0] > 0 for c in cases), times
    assert all(len(times[c]) == 5 and min(times[c]) > 0 for c in bare), times


def test_a_wrong_reference_fails_the_check_before_any_timing(monkeypatch, capsys):
  # The check a GPU session runs first must be able to fail: a reference
  # with another epsilon moves every touched row.
  sparse_step = benchmark_scripts.load("sparse_step")
  runs = recording_runs(sparse_step, monkeypatch)
  wrong = functools.partial(sparse_step.dense_adagrad_step, eps=1e-2)
  assert sparse_step.main(QUICK, reference=wrong) == 1
  assert runs == []
  assert "touched rows differ from the dense reference" in capsys.readouterr().out


def test_the_reference_leaves_untouched_rows_and_counts_invalid_ids_out():
  sparse_step = benchmark_scripts.load("sparse_step")
  table = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
  acc = np.zeros(4, np.float32)
  loss, new_table, new_acc = sparse_step.dense_adagrad_step(table, acc, np.array([2, -1, 2, 0]))
  # Row sums 2.1 (row 2, twice), 0 (the invalid id) and 0.3 (row 0).
  np.testing.assert_allclose(loss, (2 * 2.1**2 + 0.3**2) / 4, rtol=1e-6)
  np.testing.assert_array_equal(new_table[[1, 3]], table[[1, 3]])
  np.testing.assert_array_equal(new_acc[[1, 3]], 0)
  assert np.all(new_table[[0, 2]] < table[[0, 2]]) and np.all(new_acc[[0, 2]] > 0)


def test_layouts_part_times_the_grid_beside_vocab_and_hidden(capsys):
  sparse_step = benchmark_scripts.load("sparse_step")
  times = sparse_step.layouts(1000, 16, 256, 1)
  assert set(times) == {"vocab", "hidden", "grid"}
  out = capsys.readouterr().out
  # Each layout's table bytes per device and the step's received bytes,
  # the grid holding half of vocab's table a device.
  assert "grid     table     0.01 MiB/device (shard 250 x 8)" in out
  assert "vocab    table     0.02 MiB/device (shard 250 x 16)" in out


def test_the_step_bytes_count_repeats_in_the_gather_and_distinct_rows_in_the_update():
  bandwidth = benchmark_scripts.load("bandwidth")
  ids = np.array([3, 3, 3, 7, 9], np.int32)   # 5 ids, 3 distinct
  parts = bandwidth.step_bytes(ids, width=8)
  assert list(parts.values()) == [5 * 4, 5 * 8 * 4, 5 * 8 * 4, 2 * 3 * 8 * 4, 2 * 3 * 4]
  assert bandwidth.row_gradient_bytes(ids, 8) == 2 * 5 * 8 * 4
  # The copy reads and writes as many bytes in all, its buffer half of them
  # (whole float32s: up to 7 bytes fewer).
  total = sum(parts.values())
  step, buffer = bandwidth.copy_step(total)
  assert total - 8 < bandwidth.copy_bytes(buffer) <= total
  _, after = step(buffer, ids)
  assert np.array_equal(np.asarray(after), np.ones(buffer.shape, np.float32))


def test_peer_cases_start_only_the_named_pytorch_workers(monkeypatch, tmp_path):
  """``--peer-cases fused``: FBGEMM's worker alone (the others' memory left free)."""
  sparse_step = benchmark_scripts.load("sparse_step")
  started = []

  def start(col, cmd, env, notes):
    started.append(cmd[cmd.index("--variant") + 1])
    # Warmed up to the step whose loss the cases compare, as the JAX cases are.
    assert cmd[cmd.index("--warmup") + 1] == str(sparse_step.LOSS_STEP)
    return None, {}

  monkeypatch.setattr(sparse_step, "missing_note", lambda python: None)
  monkeypatch.setattr(sparse_step, "start_or_note", start)
  monkeypatch.setattr(sparse_step.jax, "default_backend", lambda: "cpu")
  for argv, want in ((["--peer-cases", "fused"], ["fused"]), ([], ["fused", "sparse", "dense"])):
    started.clear()
    args = sparse_step.build_parser().parse_args(argv)
    batches = [np.full(4, k, np.int32) for k in range(3)]
    sparse_step.start_peers(args, str(tmp_path), batches, 10, 8)
    assert started == want
    # Every worker gets every batch, in order: it steps through them as the JAX cases do.
    np.testing.assert_array_equal(np.load(tmp_path / "ids.npz")["ids"], np.stack(batches))


def test_every_case_takes_the_same_batches_in_turn_a_new_one_each_step():
  sparse_step = benchmark_scripts.load("sparse_step")
  batches = sparse_step.id_batches(16, 1000, steps=3)
  assert len(batches) == 3
  assert len({np.asarray(b).tobytes() for b in batches}) == 3   # each its own draw
  assert len(sparse_step.id_batches(16, 1000, steps=500)) == sparse_step.MAX_BATCHES
  (only,) = sparse_step.id_batches(16, 1000, steps=500, same_ids=True)
  np.testing.assert_array_equal(only, batches[0])
  seen = []

  def step(state, ids):
    seen.append(np.asarray(ids).tobytes())
    return 0.0, state

  stepper = sparse_step.Stepper(step, None, batches)
  stepper(batches[2])   # the ids passed are ignored: the first step takes the first batch
  stepper.timed(None, inner=4)
  assert seen == [np.asarray(batches[k % 3]).tobytes() for k in range(5)]


@pytest.mark.skipif(not cpu_library.available(), reason="needs the CPU kernels' library")
def test_the_rows_floor_gathers_every_id_then_writes_each_distinct_row_once_in_place():
  bandwidth = benchmark_scripts.load("bandwidth")
  ids = np.array([7, 3, 7, 9, 3, 0], np.int32)
  step, state = bandwidth.rows_step(1200, 4, ids)
  compiled = step.lower(state, ids).compile()
  # In place: no temporary the size of the table (XLA copies a donated table
  # that an in-place update does not follow the gather of), and the gradient
  # passed through, not written.
  memory = compiled.memory_analysis()
  assert memory.temp_size_in_bytes < state[0].nbytes // 10
  assert memory.alias_size_in_bytes == state[0].nbytes + state[1].nbytes
  assert "embedlib_gather" in compiled.as_text()   # kept: the update's lr reads its rows
  _, state = compiled(state, ids)
  _, (table, _) = compiled(state, ids)
  want = np.zeros((1200, 4), np.float32)
  want[[0, 3, 7, 9]] = 2.0   # each distinct row once a step, repeats or not
  np.testing.assert_array_equal(np.asarray(table), want)


@pytest.mark.skipif(cpu_library.compiler() is None, reason="needs a C++ compiler")
def test_the_bare_floor_makes_both_passes_and_checks_the_table_they_leave():
  bandwidth = benchmark_scripts.load("bandwidth")
  ids = np.array([7, 3, 7, 9, 3, 0, 1199], np.int32)
  result = bandwidth.bare_floor(1200, 4, ids, copy_total=4096, rounds=3)
  # The program checks the gathered rows and every row of the table after
  # the passes (each distinct row raised once a round, the rest untouched).
  assert result["verified"] is True
  assert result["ids"] == 7 and result["distinct"] == 5
  assert len(result["two_passes_ms"]) == len(result["copy_ms"]) == 3
  assert all(ms > 0 for ms in result["two_passes_ms"] + result["copy_ms"])
  assert result["copy_bytes"] == 4096


@pytest.mark.skipif(cpu_library.compiler() is None, reason="needs a C++ compiler")
def test_the_bare_floor_takes_a_new_batch_each_round():
  bandwidth = benchmark_scripts.load("bandwidth")
  batches = np.array([[7, 3, 7, 9, 3, 0], [5, 5, 1199, 9, 2, 8], [0, 1, 2, 3, 4, 4]], np.int32)
  # 2 untimed rounds then 4 timed: batches 0, 1, 2, 0, 1, 2. The program
  # checks each row raised once per round whose batch holds it, and the last
  # round's gathered rows read before its raise.
  result = bandwidth.bare_floor(1200, 4, batches, copy_total=4096, rounds=4)
  assert result["verified"] is True
  assert result["ids"] == 6 and result["batches"] == 3 and result["distinct"] == 4
  assert len(result["two_passes_ms"]) == 4


@pytest.mark.skipif(cpu_library.compiler() is None, reason="needs a C++ compiler")
def test_the_bare_floor_refuses_an_id_outside_the_table():
  bandwidth = benchmark_scripts.load("bandwidth")
  with pytest.raises(RuntimeError, match=r"id 1200 outside \[0, 1200\)"):
    bandwidth.bare_floor(1200, 4, np.array([3, 1200], np.int32), copy_total=4096, rounds=1)



def test_a_cpu_sample_is_several_steps_back_to_back_the_workers_too():
  # A CPU step timed alone pays the machine's wake-up (the process idled
  # through the other cases' turns): a sample is 8 steps on CPU, and each
  # PyTorch worker's sample is as many of its own steps, timed per step.
  sparse_step = benchmark_scripts.load("sparse_step")
  assert sparse_step.steps_per_sample("cpu") == 8
  assert sparse_step.steps_per_sample("gpu") == 20
  requested = []

  class Worker:
    def run(self, steps):
      requested.append(steps)
      return {"seconds": 0.004 * steps, "loss": 1.0}

  assert sparse_step.sample_ms(Worker(), 8) == pytest.approx(4.0)
  assert requested == [8]


def test_the_workers_start_at_the_step_whose_loss_the_cases_compare(monkeypatch, tmp_path):
  sparse_step = benchmark_scripts.load("sparse_step")
  monkeypatch.setattr(sparse_step, "missing_note", lambda python: None)
  monkeypatch.setattr(sparse_step.jax, "default_backend", lambda: "cpu")
  worker = object()
  monkeypatch.setattr(sparse_step, "start_or_note",
                      lambda col, cmd, env, notes: (worker, {"first_loss": 0.25}))
  args = sparse_step.build_parser().parse_args(["--peer-cases", "fused"])
  workers, losses, notes = sparse_step.start_peers(
      args, str(tmp_path), [np.zeros(4, np.int32)], 10, 8)
  assert workers == {sparse_step.FBGEMM: worker} and notes == []
  # Its ready message's loss is that of its last warm-up step: LOSS_STEP.
  assert losses == {sparse_step.FBGEMM: (0.25, sparse_step.LOSS_STEP)}


def test_the_least_step_adds_the_models_streams_to_the_bare_passes():
  # A model apart from its lookup reads the rows and writes their gradient,
  # which the update reads back: 3 x [ids, width] float32 beyond step_bytes.
  sparse_step = benchmark_scripts.load("sparse_step")
  ids = np.array([3, 1, 3, 7], np.int32)
  assert sparse_step.bandwidth.model_bytes(ids, 8) == 3 * 4 * 8 * 4
  record = Recorder()
  times = {sparse_step.SPARSE: [4.0], sparse_step.COPY: [1.0], sparse_step.DENSE: [40.0],
           sparse_step.BARE_PASSES: [3.0, 3.0], sparse_step.BARE_COPY: [2.0, 2.0]}
  sparse_step.record_ratios(record, times, 1000, 8, model_share=0.75)
  assert record.ratios["bare_floor_over_copy_1k_x_8"] == pytest.approx(1.5)
  # The passes' 1.5x the bare copy, plus the model's bytes at the copy's rate.
  assert record.ratios["least_step_over_copy_1k_x_8"] == pytest.approx(2.25)
  assert record.ratios["copy_distance_1k_x_8"] == pytest.approx(4.0)


class Recorder:
  def __init__(self):
    self.ratios, self.notes = {}, []

  def ratio(self, name, value):
    self.ratios[name] = value

  def note(self, text):
    self.notes.append(text)
