"""Raw Criteo ids into dynamic tables through ``python -m train``: stats, exact resume, bad keys."""

import os

import numpy as np
import pytest
from flax import nnx

from configs import dlrm_criteo, quickstart
from embedlib import dynamic
from embedlib.training import events, setup, tasks, train_lib
from embedlib.training.writers import read_jsonl
from tests.train.test_train import _criteo_lines

STATS = ("occupancy", "admitted", "evicted", "default_share")


def _config(path, steps):
  config = dlrm_criteo.get_config("smoke_raw")
  with config.unlocked():
    config.data.train_path, config.data.eval_holdout = str(path), 0.2
    config.num_train_steps = steps
    config.eval_batches = 2
  return config


def _tables(model):
  tables = {}
  for name, emb in model.embeddings.dynamic.items():
    tables[name] = (emb.resident(), np.asarray(emb.rows.embedding[...]),
                    int(emb.clock[...]))
  return tables


@pytest.mark.slow
def test_raw_ids_run_writes_stats_and_resumes_exactly(tmp_path):
  path = tmp_path / "day_0.tsv"
  path.write_text(_criteo_lines(400))
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  train_lib.train_and_evaluate(_config(path, 4), str(straight))
  train_lib.train_and_evaluate(_config(path, 2), str(resumed))
  train_lib.train_and_evaluate(_config(path, 4), str(resumed))

  tb = events.read_scalars(str(straight / "tensorboard" / "train"))
  for stat in STATS:
    assert [s for s, _ in tb[f"dynamic/embeddings/dynamic/C1/{stat}"]] == [2, 4]
  # 32 distinct values per feature per step, each admitted on sight into 256 rows.
  assert tb["dynamic/embeddings/dynamic/C1/occupancy"][-1][1] > 0
  assert tb["dynamic/embeddings/dynamic/C26/default_share"][-1][1] == 0.0
  # Resumed after step 2: the same loss, eval and tables as the straight run.
  last = [{k: v for k, v in read_jsonl(d / "train.jsonl")[-1].items()
           if k != "examples_per_sec"} for d in (straight, resumed)]
  assert last[0] == last[1] and last[0]["step"] == 4
  assert read_jsonl(straight / "eval.jsonl")[-1] == read_jsonl(resumed / "eval.jsonl")[-1]
  a, _ = setup.restore_model(_config(path, 4), str(straight))
  b, _ = setup.restore_model(_config(path, 4), str(resumed))
  ta, tb_ = _tables(a), _tables(b)
  assert ta.keys() == tb_.keys() and len(ta) == 26
  for name in ta:
    assert ta[name][0] == tb_[name][0] and ta[name][2] == tb_[name][2] == 4, name
    np.testing.assert_array_equal(ta[name][1], tb_[name][1])
  # The eval read the map without admitting: the clock counts the 4 training steps.
  assert len(ta["C1"][0]) > 0 and os.path.isdir(straight / "checkpoints" / "4")


# Slow: eight dynamic tables' train and eval steps compile. The fast tier's
# TensorBoard check of each table's stats is the two-tower raw-id run's
# (tests/train/test_movielens_raw_ids.py); admission's default share is
# tests/dynamic's.
@pytest.mark.slow
def test_synthetic_raw_ids_with_admission_write_each_tables_stats(tmp_path):
  config = quickstart.get_config("smoke")
  with config.unlocked():
    config.data.raw_ids = True
    config.num_train_steps, config.eval_every, config.checkpoint_every = 2, 2, 2
    config.model.dynamic.update(capacity=64, bucket_size=8, admit_after=2, eviction="lfu")
  train_lib.train_and_evaluate(config, str(tmp_path))
  record = read_jsonl(tmp_path / "train.jsonl")[-1]
  tb = events.read_scalars(str(tmp_path / "tensorboard" / "train"))
  names = [f"f{i}" for i in range(8)]
  for name in names:
    for stat in STATS:
      key = f"dynamic/embeddings/dynamic/{name}/{stat}"
      assert tb[key] == [(2, pytest.approx(record[key]))], key
  # admit_after=2: an id seen once so far reads the default row.
  shares = [record[f"dynamic/embeddings/dynamic/{n}/default_share"] for n in names]
  assert all(0.0 <= s < 1.0 for s in shares) and max(shares) > 0, shares
  admitted = [record[f"dynamic/embeddings/dynamic/{n}/admitted"] for n in names]
  occupancy = [record[f"dynamic/embeddings/dynamic/{n}/occupancy"] for n in names]
  assert all(0 < a <= o * 64 for a, o in zip(admitted, occupancy)), (admitted, occupancy)


@pytest.mark.parametrize("key,value,words", [
    ("admit_after", 0, "config.model.dynamic.admit_after"),
    ("eviction", "fifo", "config.model.dynamic.eviction: .*'none'"),
    ("capacity", 100, "config.model.dynamic.capacity"),
])
def test_bad_dynamic_setting_names_its_key(tmp_path, key, value, words):
  config = _config(tmp_path / "day.tsv", 4)
  with config.unlocked():
    config.model.dynamic[key] = value
  with pytest.raises(setup.ConfigError, match=words):
    setup.task(config)


def test_pipeline_with_raw_ids_is_a_valid_config(tmp_path):
  """The pipelined step runs dynamic tables (tests/train/test_pipeline_dynamic.py)."""
  config = _config(tmp_path / "day.tsv", 4)
  with config.unlocked():
    config.pipeline = True
  assert tasks.make_task(config).raw_ids


def test_frozen_maps_leave_the_map_alone():
  emb = dynamic.DynamicEmbed(128, 2, rngs=nnx.Rngs(0))
  with dynamic.frozen_maps(emb):
    emb(np.array([5, 6]))
  assert emb.resident() == {} and not emb.deterministic
  emb(np.array([5]))
  assert set(emb.resident()) == {5}


def test_capacity_that_does_not_split_over_the_devices_names_the_key(tmp_path):
  config = _config(tmp_path / "day.tsv", 4)
  with config.unlocked():
    config.model.dynamic.capacity = 128     # 4 buckets of 32 for 8 devices
  made = tasks.make_task(config)   # the model alone: no data file needed
  with pytest.raises(setup.ConfigError, match="config.model.dynamic.capacity: .*whole buckets"):
    setup.model_and_optimizer(config, made, made.data_spec(), setup.make_mesh(config))
