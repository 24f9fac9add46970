"""A collection's plan lists its dynamic tables: rows, slots and map a device, as held."""

import jax
import pytest
from flax import nnx

import embedlib
from configs import dlrm_criteo
from embedlib import dynamic
from embedlib.collection import DynamicSpec, FeatureSpec, TableSpec
from embedlib.plan.report import human_bytes
from embedlib.training import setup, tasks

DEVICES = 8


def _held_on_device_0(module, kind) -> int:
  """Bytes of ``module``'s variables of ``kind`` that device 0 holds."""
  total = 0
  for _, v in nnx.iter_graph(module):
    if isinstance(v, kind):
      arr = v[...]
      total += sum(s.data.nbytes for s in arr.addressable_shards if s.device.id == 0)
  return total


@pytest.fixture(scope="module")
def collection():
  mesh = jax.make_mesh((DEVICES,), ("batch",))
  tables = [TableSpec("user", 512, 8, dynamic=DynamicSpec(bucket_size=32)),
            TableSpec("item", 256, 16, dynamic=DynamicSpec(bucket_size=16, admit_after=2,
                                                           default="learned")),
            TableSpec("country", 200, 8)]
  features = [FeatureSpec(t.name, t.name) for t in tables]
  return embedlib.EmbeddingCollection(tables, features, mesh=mesh, batch_size=64,
                                      rngs=nnx.Rngs(0))


def test_the_plan_counts_what_each_device_holds_of_every_dynamic_table(collection):
  plan = collection.plan
  assert [d.name for d in plan.dynamic] == ["user", "item"]
  for d in plan.dynamic:
    table = collection.dynamic[d.name]
    assert d.map == _held_on_device_0(table, (dynamic.DynamicMap, dynamic.DynamicStats))
    assert d.rows == _held_on_device_0(table, nnx.Param)  # the learned default row included
    assert d.slots == d.capacity // DEVICES * 4           # row-wise AdaGrad: a float a row
    assert d.group == DEVICES and d.strategy == "vocab"
  # Keys, score and placement clock (16 bytes a row), the admission sketch of
  # admit_after=2 (uint8 [buckets, depth 2, width 16]), both split over the
  # devices; two clocks, the init key and four statistics on each.
  assert plan.dynamic[1].map == 256 * 16 // DEVICES + 16 * 2 * 16 // DEVICES + 32


def test_the_printed_plan_lists_the_dynamic_tables_and_their_total(collection):
  text = str(collection.plan)
  lines = text.splitlines()
  assert lines[0].startswith("EmbeddingCollection plan: 3 tables (2 dynamic), mesh batch=8")
  assert any(line.startswith("country") for line in lines)  # the planned table stays listed
  for d in collection.plan.dynamic:
    row = next(line.split() for line in lines if line.startswith(d.name + " "))
    assert row[1:4] == ["vocab", str(d.capacity), "x"]
    assert " ".join(row[5:]).split("  ")[0].startswith(human_bytes(d.rows))
    assert human_bytes(d.map) in " ".join(row) and human_bytes(d.slots) in " ".join(row)
  total = lines[-1].split()
  assert total[0] == "total" and human_bytes(
      sum(d.bytes_per_device for d in collection.plan.dynamic)) in " ".join(total)
  assert "buckets of 32 over 8 devices; admit_after=1" in text


def test_the_step_memory_line_counts_the_maps():
  config = dlrm_criteo.get_config("smoke_raw")
  task = tasks.make_task(config)
  model, optimizer = setup.model_and_optimizer(config, task, task.data_spec(),
                                               setup.make_mesh(config))
  planned = setup.planned_memory(model, optimizer)
  maps = [model.embeddings.dynamic[t.name].map_bytes_per_device() for t in planned.tables]
  assert len(planned.tables) == 26 and all(maps)
  assert planned.map == sum(maps)
  capacity, width = 256, config.model.embed_dim
  assert planned.table == 26 * capacity * width * 4 // DEVICES
  assert planned.slots == 26 * capacity * 4 // DEVICES
  assert planned.total > planned.table + planned.slots + planned.map

  class _NoAnalysis:  # a backend without a memory analysis: only the plan's part is printed
    def lower(self, *a, **k):
      return self

    def compile(self):
      return self

    def memory_analysis(self):
      return None

  line = setup.describe_step_memory(_NoAnalysis(), model, optimizer)
  assert f"map {human_bytes(planned.map)}" in line
  assert f"tables {human_bytes(planned.table)}" in line and "tables 0 B" not in line
