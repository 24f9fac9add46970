"""The plan's memory of a training step: tables, optimizer slots, ids and temporaries.

The slots are exact (what ``embedlib.optim`` allocates, checked here against
its own rules and layout); the temporaries' constants are calibrated on
compiled programs and checked against them in ``tests/gpu_compile``.
"""

import pytest

from embedlib import optim
from embedlib.plan import memory, plan_embedding
from embedlib.plan.report import human_bytes

MESH = {"batch": 8}


@pytest.mark.parametrize("strategy,rows_per_device", [
    ("routed", 125_000), ("vocab", 125_000), ("hidden", 1_000_000), ("replicated", 1_000_000)])
@pytest.mark.parametrize("optimizer,row_slots,table_slots", [
    ("sgd", 0, 0), ("rowwise_adagrad", 1, 0), ("lazy_adam", 1, 2)])
def test_slots_are_the_optimizers_laid_out_like_the_table(strategy, rows_per_device, optimizer,
                                                          row_slots, table_slots):
  p = plan_embedding(1_000_000, 64, mesh=MESH, sharding=strategy)
  m = p.memory(optimizer=optimizer)
  assert m.table == p.bytes_per_device
  # Row slots split with a row layout's rows, whole on each rank of the others.
  assert m.slots == row_slots * rows_per_device * 4 + table_slots * p.bytes_per_device


def test_the_optimizers_own_rules_give_the_same_slots_as_their_names():
  for name, rule in (("rowwise_adagrad", optim.RowWiseAdagrad()), ("lazy_adam", optim.LazyAdam()),
                     ("sgd", optim.SparseSGD())):
    assert memory.slot_layout(rule) == memory.slot_layout(name)
  p = plan_embedding(1000, 64, mesh=MESH, sharding="vocab", optimizer=optim.LazyAdam())
  assert p.memory().slots == p.memory(optimizer="lazy_adam").slots
  assert p.memory(optimizer="rowwise_adagrad").slots == 125 * 4 < p.memory().slots


def test_an_unknown_optimizer_names_the_known_ones():
  with pytest.raises(ValueError, match="rowwise_adagrad"):
    plan_embedding(1000, 64, mesh=MESH, optimizer="adamw")


def test_temporaries_grow_with_the_ids_and_a_device_holds_one_exchange_at_a_time():
  p = plan_embedding(1_000_000, 64, mesh=MESH, sharding="routed")
  small, large = p.memory(256), p.memory(8192)
  assert small.ids == 1024 and large.ids == 32768
  assert large.temporary > 8 * (small.temporary - memory.SMALL_BUFFERS["routed"])
  one = memory.device_memory([(p, 8192, None, 8192)])
  two = memory.device_memory([(p, 8192, None, 8192)] * 2)
  t = dict(one.tables[0].temporaries)
  # 8192 ids: the fallback's partial rows from 8 ranks and their ids.
  assert t["lookup"] == 8 * 8192 * (256 + 4)
  assert t["returned"] == 8192 * 256 + memory.LOOKUP_ID_WORDS * 4 * 8192
  assert two.table == 2 * one.table and two.slots == 2 * one.slots
  # One table's exchange (or update) buffers at a time, beside both tables' rows (or gradients).
  assert two.temporary == max(t["lookup"] + 2 * t["returned"], t["update"] + 2 * t["kept"]) + (
      2 * t["small"])
  assert one.temporary == max(t["lookup"] + t["returned"], t["update"] + t["kept"]) + t["small"]
  assert two.total == two.table + two.slots + two.ids + two.temporary


def test_auto_fits_the_whole_step_not_the_table_alone():
  mesh = {"fsdp": 2, "tensor": 4}
  table_1d = 256 << 20  # a 1-D layout's shard of a 1 GiB table
  roomy = plan_embedding(1 << 20, 256, mesh=mesh, device_memory_bytes=600 << 20)
  assert roomy.strategy != "grid" and roomy.bytes_per_device == table_1d
  # The 1-D table fits this budget; with its slots and temporaries it doesn't.
  tight = plan_embedding(1 << 20, 256, mesh=mesh, device_memory_bytes=table_1d + (1 << 19))
  assert tight.strategy == "grid" and "doesn't fit" in tight.reason
  # Adam's two table slots triple a 1-D step (768 MiB): a grid's fits 600 MiB.
  adam = plan_embedding(1 << 20, 256, mesh=mesh, device_memory_bytes=600 << 20,
                        optimizer="lazy_adam")
  assert adam.strategy == "grid" and adam.memory_per_device <= 600 << 20
  assert roomy.memory(optimizer="lazy_adam").total > 600 << 20


def test_the_printed_plan_states_the_steps_memory():
  text = str(plan_embedding(1_000_000, 64, mesh=MESH, sharding="routed"))
  assert "memory/step" in text and "rowwise_adagrad slots 488.28 KiB" in text


def test_a_devices_memory_is_stated_per_table_and_in_total():
  a = plan_embedding(1_000_000, 64, mesh=MESH, sharding="routed", name="a")
  b = plan_embedding(1000, 16, mesh=MESH, sharding="vocab", name="b")
  device = memory.device_memory([a, b], "lazy_adam")
  lines = device.describe()
  assert [line.split()[0] for line in lines] == ["a", "b", "per"]
  assert "(lazy_adam)" in lines[-1] and lines[-1].endswith(human_bytes(device.total))
  # One table's exchange buffers at a time: less than the two tables' sum.
  assert device.total < sum(t.total for t in device.tables)
  assert device.table == a.bytes_per_device + b.bytes_per_device
