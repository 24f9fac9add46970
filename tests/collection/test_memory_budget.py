"""The collection's ``device_memory_bytes``: the whole training step a device holds, not its tables.

Pure Python (no arrays): the byte counts are the plan's
(``embedlib.plan.memory``, checked against compiled steps in
``tests/gpu_compile/test_plan_memory.py``), worked out here by hand.
"""

import pytest

from embedlib.collection import FeatureSpec, TableSpec, plan_collection
from embedlib.plan import memory

MESH = {"batch": 8}
BATCH = 1024  # 128 samples a device


def test_a_budget_for_the_tables_alone_is_refused_and_the_whole_step_fits():
  tables = [TableSpec("big", 100_000, 64, sharding="vocab")]
  feats = [FeatureSpec("f", "big", max_ids_per_sample=4)]  # pooled: 512 ids, 128 rows a device
  kw = dict(mesh=MESH, batch_size=BATCH)
  plan = plan_collection(tables, feats, **kw)["big"].plan
  table = 12_500 * 64 * 4  # 100,000 rows over 8 devices
  slots = 12_500 * 4  # row-wise AdaGrad: a float a row
  ids = 512 * 4
  entry = 4 + 64 * 4  # an id and its row gradient
  assert plan.sparse_update(512)[0] == "route" and plan.update_capacity(512) == 94
  # The update's row gradients with their ids and the touched rows' slots, and
  # its route to the owners (94 a destination, sent and received): more than
  # the lookup's gathered ids and partial rows, 8 * (512 * 4 + 128 * 256).
  update = 512 * (entry + 4) + 2 * 8 * 94 * entry
  kept = int(memory.KEPT_ENTRIES * 512 * entry)  # every table's row gradients, kept for it
  # The peak is the update's: more than the lookup's gathered ids and partial
  # rows beside the rows it returned and its ids' bookkeeping.
  lookup = 8 * (512 * 4 + 128 * 256)
  returned = 128 * 256 + memory.LOOKUP_ID_WORDS * 4 * 512
  assert (update, kept, lookup + returned) == (526_208, 282_880, 339_968)
  small = 17 * 256  # memory.SMALL_BUFFERS["vocab"]
  total = table + slots + ids + update + kept + small
  assert total == 4_065_488

  plan_collection(tables, feats, device_memory_bytes=total, **kw)
  for budget in (total - 1, table + slots + ids):
    with pytest.raises(ValueError) as e:
      plan_collection(tables, feats, device_memory_bytes=budget, **kw)
  assert str(e.value) == (
      "the embedding's training step doesn't fit device memory: a device needs 3.88 MiB, more "
      "than device_memory_bytes=3252048 (3.10 MiB): tables 3.05 MiB, rowwise_adagrad slots "
      "48.83 KiB, ids 2.00 KiB, temporaries 794.38 KiB (the sparse update's buffers 513.88 KiB, "
      "the row gradients kept for it 276.25 KiB, small buffers 4.25 KiB). table 'big' holds "
      "the most (3.05 MiB a device): shard it over more devices; or take a smaller batch_size "
      "(the ids and temporaries grow with it), an optimizer with fewer slots, or raise "
      "device_memory_bytes.")
  # SGD keeps no slots (none at rest, none travelling with the update).
  plan_collection(tables, feats, device_memory_bytes=total - slots - 512 * 4, optimizer="sgd",
                  **kw)
  # LazyAdam's two moments laid out like the table and a count a row: 2 * 3,200,000 + 50,000.
  with pytest.raises(ValueError, match=r"lazy_adam slots 6.15 MiB"):
    plan_collection(tables, feats, device_memory_bytes=total, optimizer="lazy_adam", **kw)


def test_a_stacks_block_is_counted_with_its_slots_and_temporaries():
  tables = [TableSpec("a", 30_000, 64, sharding="table"), TableSpec("b", 20_000, 64,
                                                                     sharding="table")]
  feats = [FeatureSpec("fa", "a", max_ids_per_sample=2), FeatureSpec("fb", "b")]
  kw = dict(mesh=MESH, batch_size=BATCH)
  stack = plan_collection(tables, feats, **kw).stack("stack_64")
  # Each table whole on a device: a device's block is the larger table's rows.
  assert stack.plan.placement.rows_per_rank == 30_000
  table, slots, ids = 30_000 * 64 * 4, 30_000 * 4, (256 + 128) * 4
  step = stack.plan.memory(256 + 128, rows=128 + 128)  # pooled: a row a sample a feature
  assert (step.table, step.slots, step.ids) == (table, slots, ids)
  assert step.total == table + slots + ids + step.temporary == 9_189_760
  plan_collection(tables, feats, device_memory_bytes=step.total, **kw)
  for budget in (step.total - 1, table + slots + ids):
    with pytest.raises(ValueError, match=(
        r"a device needs 8.76 MiB.*tables 7.32 MiB, rowwise_adagrad slots 117.19 KiB, ids "
        r"1.50 KiB, temporaries .*stack 'stack_64' holds the most \(7.32 MiB of rows a "
        r"device\), table 'a' the largest part: shard 'a' by rows")):
      plan_collection(tables, feats, device_memory_bytes=budget, **kw)


def test_auto_takes_the_cheapest_layout_whose_step_fits():
  tables = [TableSpec("t", 500, 64)]
  feats = [FeatureSpec("f", "t", max_ids_per_sample=8, combiner=None)]  # 1024 ids and rows
  kw = dict(mesh=MESH, batch_size=BATCH)
  free = plan_collection(tables, feats, **kw)["t"].plan
  assert free.strategy == "replicated"  # its gradients' all-reduce moves the fewest bytes
  copy = free.memory(1024, rows=1024).total
  hidden = plan_collection([TableSpec("t", 500, 64, sharding="hidden")], feats,
                           **kw)["t"].plan.memory(1024, rows=1024).total
  assert (hidden, copy) == (992_544, 1_104_544)
  # The routed and vocab steps (more than 1 MiB: a route or gather of 1024
  # rows) fit neither budget; between the hidden step and the copy's, hidden.
  tight = plan_collection(tables, feats, device_memory_bytes=hidden, **kw)["t"].plan
  assert tight.strategy == "hidden"
  assert "routed's step doesn't fit device_memory_bytes" in tight.reason
  assert "a copy per device would move" in tight.reason and "does not fit" in tight.reason
  assert plan_collection(tables, feats, device_memory_bytes=copy,
                         **kw)["t"].plan.strategy == "replicated"


def test_small_tables_go_table_wise_only_where_the_step_still_fits():
  many = [TableSpec(f"t{i}", 2000, 16) for i in range(20)]
  feats = [FeatureSpec(t.name, t.name, max_ids_per_sample=1) for t in many]
  kw = dict(mesh=MESH, batch_size=BATCH, replicate_below_bytes=0, table_batched=True)
  kinds = lambda plan: {plan[t.name].kind for t in many}
  free = plan_collection(many, feats, **kw)
  # Table-wise, 20 tables over 8 devices move fewer bytes than split by
  # rows, but a device holds three whole tables (6000 rows) where rows
  # split hold 5000 (the stack's placement, a row block a device).
  assert kinds(free) == {"table"}
  whole = free.stack("stack_16").plan
  routed = plan_collection([TableSpec(t.name, 2000, 16, sharding="routed") for t in many], feats,
                           **kw).stack("stack_16").plan
  assert (whole.placement.rows_per_rank, routed.placement.rows_per_rank) == (6000, 5000)
  step = lambda p: p.memory(20 * 128).total  # 20 single-id features, 128 samples a device
  assert (step(whole), step(routed)) == (2_127_808, 2_059_808)
  assert kinds(plan_collection(many, feats, device_memory_bytes=2_127_808, **kw)) == {"table"}
  tight = plan_collection(many, feats, device_memory_bytes=2_127_807, **kw)
  assert kinds(tight) == {"routed"} and tight.bytes_moved > free.bytes_moved


def test_the_modules_pass_their_optimizer_to_the_plan():
  """``EmbeddingCollection`` and ``ShardedEmbed`` budget the slots of the optimizer they're given."""
  import jax  # pylint: disable=g-import-not-at-top  (the rest of this file needs no arrays)
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from embedlib import EmbeddingCollection, ShardedEmbed  # pylint: disable=g-import-not-at-top
  from embedlib.plan import plan_embedding  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
  tables = [TableSpec("t", 800, 8, sharding="vocab")]
  feats = [FeatureSpec("f", "t", max_ids_per_sample=2)]
  kw = dict(mesh=mesh, batch_size=64)
  sgd = plan_collection(tables, feats, optimizer="sgd", **kw)["t"].plan.memory(16, rows=8,
                                                                               optimizer="sgd")
  assert sgd.slots == 0
  with pytest.raises(ValueError, match="rowwise_adagrad slots"):
    EmbeddingCollection(tables, feats, device_memory_bytes=sgd.total, rngs=nnx.Rngs(0), **kw)
  coll = EmbeddingCollection(tables, feats, device_memory_bytes=sgd.total, optimizer="sgd",
                             rngs=nnx.Rngs(0), **kw)
  assert coll.plan["t"].plan.strategy == "vocab"

  # A small table is copied to every device; with row-wise AdaGrad's slots
  # the copy's step no longer fits the budget the SGD copy's does.
  one = dict(mesh=mesh, ids_per_device=16)
  budget = plan_embedding(800, 8, optimizer="sgd", **one).memory_per_device
  strategy = lambda **o: ShardedEmbed(800, 8, device_memory_bytes=budget, rngs=nnx.Rngs(0),
                                      **one, **o).plan.strategy
  assert (strategy(optimizer="sgd"), strategy()) == ("replicated", "routed")
