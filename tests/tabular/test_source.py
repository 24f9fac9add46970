"""TabularSource: exact resume with grain workers, process shards, a padded last batch, flat memory."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedlib import tabular
from embedlib.tabular import files as files_lib
from tests.tabular import logs
from tests.tabular import reference as ref

ROWS = logs.click_rows(50, seed=2)
SPLIT = tabular.Split("hash", eval_fraction=0.2)


@pytest.fixture(scope="module")
def clicks(tmp_path_factory):
  """The click log as a CSV file read in chunks of 7 lines (8 chunks), prepared once."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(files_lib, "CHUNK_ROWS", 7)
    path = logs.write_text(tmp_path_factory.mktemp("source") / "clicks.csv", ROWS)
    data = tabular.prepare(path, logs.HINTS, split=SPLIT)
    # Chunks are computed here, in the parent, and handed to the workers with the reading.
    readings = {p: data.reading(p) for p in ("train", "eval")}
  assert len(readings["train"].chunks) == 8
  return data, readings


def source(clicks, part="train", **kw):
  data, readings = clicks
  reading = readings[part]
  share = {k: kw.pop(k) for k in ("shuffle", "seed", "process_index", "process_count") if k in kw}
  return tabular.TabularSource(dataclasses.replace(reading, **share), data.featurizer, **kw)


def ids(batch) -> list:
  """A batch's rows by their timestamps (unique a row)."""
  return batch["timestamp"].astype(np.int64).tolist()


def assert_same(a, b):
  assert len(a) == len(b) > 0
  for x, y in zip(a, b):
    ref.assert_equal(x, y)


def test_resume_mid_file_with_workers_equals_an_uninterrupted_run(clicks):
  kw = dict(batch_size=6, num_epochs=3, shuffle=True, seed=7)
  here = source(clicks, **kw)
  expected, states = [], []
  for batch in here:
    expected.append(batch)
    states.append(here.get_state())
  train = sum(SPLIT.mask("train", np.arange(len(ROWS)), None))
  assert len(expected) == 3 * (train // 6) and here.dropped_examples == 3 * (train % 6)
  orders = [ids(b) for b in expected]
  assert orders[:len(orders) // 3] != orders[len(orders) // 3:2 * len(orders) // 3]  # reshuffled
  k = 4
  assert states[k - 1]["row"] != 0 and states[k - 1]["chunk"] > 0  # mid-file, mid-chunk

  workers = source(clicks, workers=2, **kw)
  workers.set_state(states[k - 1])
  got = [next(workers) for _ in range(len(expected) - k - 2)]
  assert_same(got, expected[k:-2])
  assert workers.get_state() == states[-3]
  workers.close()
  resumed = source(clicks, **kw)  # ... and in this process again, from the workers' state
  resumed.set_state(workers.get_state())
  assert_same(list(resumed), expected[-2:])


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_processes_read_the_rows_of_one_disjointly(clicks, shuffle):
  train = [r["timestamp"] for r, m in zip(ROWS, SPLIT.mask("train", np.arange(len(ROWS)), None))
           if m]

  def epochs(**kw):
    """The rows of each of 2 epochs, by their ids (each epoch holds its rows once)."""
    src = source(clicks, batch_size=8, num_epochs=2, pad_last=True, shuffle=shuffle, **kw)
    rows = [t for b in src for t, m in zip(ids(b), b["mask"]) if m]
    assert len(rows) % 2 == 0
    out = [rows[:len(rows) // 2], rows[len(rows) // 2:]]
    assert all(len(set(e)) == len(e) for e in out)
    return [set(e) for e in out]

  one = epochs()
  two = [epochs(process_index=p, process_count=2) for p in (0, 1)]
  for e in (0, 1):
    assert one[e] == set(train)  # every training row, once an epoch
    assert not two[0][e] & two[1][e] and two[0][e] | two[1][e] == one[e]
  assert two[0][0] == {r["timestamp"] for i, r in enumerate(ROWS)
                       if i % 2 == 0 and r["timestamp"] in train}  # row r is process r % 2's


def test_pad_last_pads_the_eval_sources_last_batch_with_a_mask(clicks):
  batches = list(source(clicks, "eval", batch_size=4, num_epochs=1, pad_last=True))
  held = [r["timestamp"] for r, m in zip(ROWS, SPLIT.mask("eval", np.arange(len(ROWS)), None))
          if m]
  assert len(held) % 4  # a partial last batch
  assert len(batches) == -(-len(held) // 4)
  for b in batches[:-1]:
    assert b["mask"].tolist() == [1.0] * 4 and b["label"].shape == (4,)
  last, n = batches[-1], len(held) % 4
  assert last["mask"].tolist() == [1.0] * n + [0.0] * (4 - n) and last["mask"].dtype == np.float32
  assert ids(last) == held[-n:] + [held[-1]] * (4 - n)  # padding repeats the last row
  assert last["sparse"]["tags"].shape == (4, 3) and last["dense"].shape == (4, 2)
  assert [t for b in batches for t, m in zip(ids(b), b["mask"]) if m] == held
  dropped = source(clicks, "eval", batch_size=4, num_epochs=1)
  assert len(list(dropped)) == len(held) // 4 and dropped.dropped_examples == n


_MEASURE = textwrap.dedent("""
    import json, sys, tracemalloc
    import pyarrow as pa, pyarrow.compute, pyarrow.csv, pyarrow.parquet
    from embedlib import tabular

    def read(path):  # every row twice: the statistics pass, then the batches
      data = tabular.prepare(path, tabular.Hints(labels=("y",)))
      return sum(len(b["label"]) for b in data.source("all", batch_size=1000, num_epochs=1))

    pool = pa.default_memory_pool()
    tracemalloc.start()
    out = {}
    for name, path in zip(("small", "large"), sys.argv[1:]):
      tracemalloc.reset_peak()
      rows = read(path)
      # Arrow's peak can't be reset: the large file's is the peak of both runs.
      out[name] = {"rows": rows, "arrow": pool.max_memory(),
                   "numpy": tracemalloc.get_traced_memory()[1]}
    print(json.dumps(out))
""")


def _log(path, groups, per_group=4000):
  rng = np.random.default_rng(0)
  n = groups * per_group
  lengths = rng.integers(0, 4, n)
  price = rng.uniform(0, 100, n)
  price[::7] = np.nan
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  pq.write_table(pa.table({
      "item": rng.integers(0, 50, n), "shop": rng.integers(0, 20, n).astype(np.int32),
      "price": pa.array(price, from_pandas=True), "views": rng.uniform(0, 1, n),
      "cats": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 30, lengths.sum()))),
      "y": rng.integers(0, 2, n)}), path, row_group_size=per_group)
  return str(path), pq.read_table(path).nbytes


def test_reading_holds_a_few_row_groups_however_large_the_file(tmp_path):
  small, small_bytes = _log(tmp_path / "small.parquet", 3)
  large, large_bytes = _log(tmp_path / "large.parquet", 32)
  group = small_bytes / 3
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", _MEASURE, small, large], env=env, check=True,
                       capture_output=True, text=True, timeout=120)
  peak = json.loads(out.stdout.strip().splitlines()[-1])
  assert (peak["small"]["rows"], peak["large"]["rows"]) == (3 * 4000, 32 * 4000)
  # Read a row group at a time: Arrow's peak is a few row groups' columns (Parquet decodes
  # a row group's columns on threads, so it varies a little), where a whole-file read would
  # hold the large file's 32; numpy and Python's peak is the same for 10 times the rows.
  assert peak["large"]["arrow"] < 6 * group < large_bytes / 5, (peak, group, large_bytes)
  assert peak["large"]["numpy"] <= 1.2 * peak["small"]["numpy"] + (64 << 10), peak
