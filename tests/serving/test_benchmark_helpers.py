"""The helpers of benchmarks/serving.py and benchmarks/quantized.py that their figures rest on."""

import sys

import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib.data import movielens
from tests import benchmark_scripts


@pytest.fixture(scope="module")
def serving():
  return benchmark_scripts.load("serving")


def test_batches_hold_skewed_ids_in_range(serving, tmp_path):
  path = tmp_path / "b.npz"
  serving.write_batches(str(path), num=2, batch=512, rows=1_000)
  data = np.load(path)
  assert data["dense"].shape == (2, 512, 13) and data["dense"].dtype == np.float32
  assert data["sparse"].shape == (2, 512, 26) and data["sparse"].dtype == np.int32
  ids = data["sparse"]
  assert ids.min() >= 0 and ids.max() < 1_000
  column = ids[..., 3].ravel()
  # Zipf(1.2): the hottest row is far above a uniform draw's share (1/1000).
  assert np.bincount(column).max() / column.size > 0.1
  # ... and each table's hottest row is its own.
  assert len({np.bincount(ids[..., t].ravel()).argmax() for t in range(26)}) > 1


def test_run_child_reads_the_child_peak_not_the_parent(serving):
  parent = np.ones(1_200 << 17)  # 1,200 MiB here, which a child forked from here starts with
  out, _, peak = serving.run_child(
      [sys.executable, "-c", "import numpy as np; a = np.ones(300 << 17); print(a.sum())"],
      "allocating")
  assert out.strip() == str(float(300 << 17))
  assert 300 <= peak < 1_000  # 300 MiB of float64, plus numpy
  del parent
  with pytest.raises(RuntimeError, match=r"failing failed \(exit 3\)(.|\n)*boom"):
    serving.run_child([sys.executable, "-c",
                       "import sys; print('boom', file=sys.stderr); sys.exit(3)"], "failing")


def test_planted_movielens_is_a_ring_walk_the_loader_reads(tmp_path):
  quantized = benchmark_scripts.load("quantized")
  folder = quantized.planted_movielens(str(tmp_path / "ml"), num_users=30, num_items=100)
  rows = np.loadtxt(tmp_path / "ml" / "u.data", dtype=np.int64)
  steps = []
  for user in range(1, 31):
    items = rows[rows[:, 0] == user, 1]
    assert 20 <= len(items) <= 80
    steps += list((np.diff(items) % 100))
  share = np.isin(steps, (1, 2, 3)).mean()
  assert 0.75 < share < 0.9  # 80% planted steps, plus jumps that land 1-3 ahead by chance
  split = movielens.load(folder)
  assert split.num_users == 30 and split.num_items <= 100


def test_table_bytes_count_each_tables_stored_bytes_once():
  quantized = benchmark_scripts.load("quantized")

  class Two(nnx.Module):
    def __init__(self):
      self.a = embedlib.ShardedEmbed(50, 16, rngs=nnx.Rngs(0))
      self.b = embedlib.ShardedEmbed(30, 8, rngs=nnx.Rngs(1))
      self.tied = self.a  # shared: counted once

  model = Two()
  assert quantized.table_bytes(model) == (50 * 16 + 30 * 8) * 4
  q = embedlib.quantize(nnx.clone(model), 4)
  # int4: 8 and 4 bytes of codes a row, 4 of fp16 scale and bias.
  assert quantized.table_bytes(q) == q.a.nbytes + q.b.nbytes == 50 * 12 + 30 * 8
