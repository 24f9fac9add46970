"""Table-wise, table-row-wise and row-wise tables in stacks: the reference, the planner, errors.

Stacked tables are checked as every layout is: each feature's output and
each table's gradient against the unsharded reference
(``tests/collection/reference.py``) on its logical table. Tolerance: f32
sums of a few rows in another order, 1e-5 relative.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embedlib import EmbeddingCollection, FeatureSpec, TableSpec
from embedlib.collection import plan_collection
from embedlib.plan import placement
from tests.collection import check

TABLES = (
    TableSpec("big", 3000, 8, sharding="routed"),  # row-wise, in the stack with table_batched
    TableSpec("mid", 300, 8, sharding="table_row"),
    TableSpec("a", 50, 8, sharding="table"),
    TableSpec("b", 40, 8, sharding="table", device=3),
    TableSpec("c", 30, 4, sharding="table"),  # a stack of its own width
    TableSpec("small", 20, 8),  # auto: replicated
)
FEATURES = (
    FeatureSpec("f_big", "big", combiner="mean"),
    FeatureSpec("f_big_seq", "big", combiner=None),
    FeatureSpec("f_mid", "mid", combiner=None),
    FeatureSpec("f_a", "a", max_ids_per_sample=1),
    FeatureSpec("f_b", "b", combiner="sqrtn"),
    FeatureSpec("f_c", "c"),
    FeatureSpec("f_small", "small"),
)
BATCH = 12


def make_inputs(seed=0):
  rng = np.random.default_rng(seed)
  rows = {t.name: t.num_embeddings for t in TABLES}
  shape = {"f_big": (BATCH, 3), "f_big_seq": (BATCH, 2), "f_mid": (BATCH, 2), "f_a": (BATCH,),
           "f_b": (BATCH, 3), "f_c": (BATCH, 2), "f_small": (BATCH, 2)}
  inputs = {f.name: rng.integers(-1, rows[f.table] + 2, shape[f.name]) for f in FEATURES}
  weights = {"f_big": rng.uniform(0.5, 2.0, shape["f_big"]).astype(np.float32)}
  return inputs, weights


MESHES = {
    "8": lambda: (jax.make_mesh((8,), ("batch",)), {"devices_per_host": 4}),
    "4x2_all": lambda: (jax.make_mesh((4, 2), ("data", "model")),
                        {"table_axes": ("data", "model")}),
    "2x4_tp": lambda: (jax.make_mesh((2, 4), ("data", "model")), {}),
}


def build(mesh_name, **kw):
  mesh, extra = MESHES[mesh_name]()
  return EmbeddingCollection(TABLES, FEATURES, mesh=mesh, table_batched=True,
                             batch_size=BATCH, rngs=nnx.Rngs(0), **extra, **kw)


def logical_tables(coll):
  return {t.name: jnp.asarray(np.asarray(coll.logical_table(t.name))) for t in TABLES}


def table_grads(coll, grads):
  """Per table, the logical gradient: a stack's split by member."""
  out = {}
  for name in coll.tables:
    out[name] = np.asarray(grads["tables"][name]["embedding"][...])
  for s in coll.plan.stacks:
    g = np.asarray(grads["stacks"][s.name]["embedding"][...])  # the stack's logical rows
    for member, rows in s.plan.placement.members:
      start = s.plan.placement.start(member)
      out[member] = g[start:start + rows]
  return out


# Every mesh once, and the stack's dedup on and off, on and with ranks that
# share ids (the tensor-parallel mesh): each case compiles a whole
# collection's forward and backward.
@pytest.mark.parametrize("mesh_name, num_unique",
                         [("8", None), ("4x2_all", 64), ("2x4_tp", 64)])
def test_outputs_and_gradients_match_reference(mesh_name, num_unique):
  coll = build(mesh_name, num_unique=num_unique and {"stack_8": num_unique})
  assert {s.name for s in coll.plan.stacks} == {"stack_8", "stack_4"}
  inputs, weights = make_inputs()
  x = {k: jnp.asarray(v) for k, v in inputs.items()}
  w = {k: jnp.asarray(v) for k, v in weights.items()}
  got, grads, want, want_grads = check.outputs_and_gradients(
      coll, lambda m: m(x, w), logical_tables(coll), FEATURES, inputs, weights, seed=2)
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6,
                               err_msg=k)
  got_grads = table_grads(coll, grads)
  for t in TABLES:
    np.testing.assert_allclose(got_grads[t.name][:, : t.features], want_grads[t.name],
                               rtol=1e-5, atol=1e-6, err_msg=t.name)
    assert np.abs(want_grads[t.name]).sum() > 0, t.name


def test_plan_places_and_prints_every_table():
  coll = nnx.eval_shape(lambda: build("8"))  # the plan alone: no table is initialised
  plan = coll.plan
  stack = plan.stack("stack_8")
  assert stack.members == ("big", "mid", "a", "b")
  p = stack.plan.placement
  assert p.devices("big") == tuple(range(8))
  assert p.devices("mid") in ((0, 1, 2, 3), (4, 5, 6, 7))  # one host of 4 devices
  assert p.devices("b") == (3,)  # pinned
  assert len(p.devices("a")) == 1
  assert plan["a"].kind == "table" and plan["mid"].kind == "table_row"
  assert plan["big"].kind == "routed" and plan["small"].kind == "replicated"
  text = str(plan)
  assert "stack_8 placement" in text and "device 3:" in text and ", b" in text
  lines = text.split("\n")
  row = next(i for i, line in enumerate(lines) if line.split()[:1] == ["a"])
  assert f"device {p.devices('a')[0]}" in lines[row + 1]  # wrapped below the row of "a"
  # Logical rows don't depend on the placement: the members one after the other.
  assert p.num_embeddings == 3000 + 300 + 50 + 40 and p.start("b") == 3350


def test_greedy_balances_lookups_and_rows():
  members = [placement.Member(f"t{i}", 100, 64, "table") for i in range(8)]
  members += [placement.Member("hot", 100, 512, "table")]
  p = placement.place(members, group=4)
  per_device = [[m for m, _ in p.members if p.devices(m) == (d,)] for d in range(4)]
  hot = next(d for d in range(4) if "hot" in per_device[d])
  assert len(per_device[hot]) == 1  # the hot table's device takes no other
  assert sorted(len(m) for m in per_device) == [1, 2, 3, 3]
  assert p.rows_per_rank == 300


def test_table_batched_stacks_routed_tables_and_weighs_table_wise():
  tables = [TableSpec("user", 1 << 16, 16), TableSpec("day", 700, 16), TableSpec("hour", 24, 16)]
  feats = [FeatureSpec(t.name, t.name, max_ids_per_sample=1) for t in tables]
  kw = dict(mesh={"batch": 8}, batch_size=4096, replicate_below_bytes=0)
  plan = plan_collection(tables, feats, table_batched=True, **kw)
  assert plan["day"].stack == plan["hour"].stack == plan["user"].stack == "stack_16"
  alone = plan_collection(tables, feats, **kw)
  assert not alone.stacks
  assert plan.bytes_moved < alone.bytes_moved  # one route for the three
  # Every lookup of "day" on one device would fill that device's bucket: the
  # planner tried it and kept the rows split.
  assert [plan[t.name].kind for t in tables] == ["routed", "routed", "routed"]
  pinned = plan_collection([tables[0], TableSpec("day", 700, 16, sharding="table"), tables[2]],
                           feats, table_batched=True, **kw)
  assert pinned["day"].kind == "table"
  assert pinned.bytes_moved > plan.bytes_moved
  # Many light tables balance over the devices: table-wise then moves no more.
  many = [TableSpec(f"t{i}", 100, 16) for i in range(16)]
  light = plan_collection(many, [FeatureSpec(t.name, t.name, max_ids_per_sample=1)
                                 for t in many], table_batched=True, **kw)
  assert {light[t.name].kind for t in many} == {"table"}


@pytest.mark.parametrize("tables, kwargs, match", [
    ([TableSpec("country", 200, 8, sharding="table", device=9)], {},
     r"table 'country': device=9 is not a device of the table group \(8 devices: 0..7\); "
     r"pick one of those, or device=None"),
    ([TableSpec("country", 200, 8, sharding="table_row", host=2)], {"devices_per_host": 4},
     r"table 'country': host=2 is not a host of the table group \(2 hosts of 4 devices"),
    ([TableSpec("big", 100_000, 64, sharding="table")], {"device_memory_bytes": 1 << 24},
     r"doesn't fit device memory: a device needs 26.99 MiB, more than "
     r"device_memory_bytes=16777216 \(16.00 MiB\): tables 24.41 MiB, rowwise_adagrad slots "
     r"390.62 KiB, .*stack 'stack_64' holds the most \(24.41 MiB of rows a device\), table "
     r"'big' the largest part: shard 'big' by rows"),
    ([TableSpec("big", 100_000, 64, sharding="vocab")], {"device_memory_bytes": 1 << 20},
     r"a device needs 4.27 MiB.*tables 3.05 MiB.*table 'big' holds the most \(3.05 MiB a "
     r"device\): shard it over more devices"),
    ([TableSpec("t", 200, 8, sharding="table")], {"devices_per_host": 3},
     r"stack_8: devices_per_host=3 does not divide the table group of 8 devices"),
])
def test_bad_placements_name_the_table_the_number_and_the_fix(tables, kwargs, match):
  feats = [FeatureSpec("f", tables[0].name)]
  with pytest.raises(ValueError, match=match):
    plan_collection(tables, feats, mesh={"batch": 8}, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(route_capacity={"a": 8}), r"route_capacity names table 'a', which lives in stack "
                                    r"'stack_8' .*pass route_capacity=\{'stack_8': N\}"),
    (dict(num_unique={"b": 8}), r"num_unique names table 'b', which lives in stack 'stack_8'"),
    (dict(route_capacity={"stack_8": 0}), r"table 'stack_8': route_capacity must be an int "
                                          r">= 1 \(ids per destination rank\), got 0"),
])
def test_capacities_of_stacked_tables_name_the_stack(kwargs, match):
  with pytest.raises(ValueError, match=match):
    build("8", **kwargs)


@pytest.mark.parametrize("spec, match", [
    (dict(sharding="routed", device=2), r"table 't': device=2 pins a 'table' placement"),
    (dict(sharding="table", device=-1), r"table 't': device must be an int >= 0, got -1"),
    (dict(sharding="table", host=0), r"host=0 pins a 'table_row' placement"),
])
def test_pins_need_their_placement(spec, match):
  with pytest.raises(ValueError, match=match):
    TableSpec("t", 10, 4, **spec)


# 64 wide: a repeat saves a 256-byte row, more than dedup's work on an id
# (``cost.DEDUP_BYTES_PER_ID``), so the repeat rate decides.
DEDUP_TABLES = (
    TableSpec("few", 24, 64, sharding="routed"),    # 64 ids a shard over 24 rows: dedup pays
    TableSpec("many", 4000, 64, sharding="routed"),  # 16 ids a shard over 4000 rows: it doesn't
    TableSpec("t", 16, 64, sharding="table"),       # a stack of one 16-row table: it pays
)
DEDUP_FEATURES = (
    FeatureSpec("f_few", "few", max_ids_per_sample=8),
    FeatureSpec("f_many", "many", combiner=None, max_ids_per_sample=2),
    FeatureSpec("f_t", "t", combiner="mean", max_ids_per_sample=8),
)


def test_a_skewed_stacks_update_routes_the_distinct_ids_its_dedup_plans():
  """Members' ``id_skew`` size the stack's dedup and its update's route alike."""
  tables = [TableSpec("a", 20_000, 64, sharding="table", id_skew=1.1),
            TableSpec("b", 5_000, 64, sharding="table")]
  features = [FeatureSpec("fa", "a", max_ids_per_sample=8), FeatureSpec("fb", "b")]
  kw = dict(mesh={"batch": 8}, batch_size=1024, num_unique={"stack_64": "auto"})
  stack = plan_collection(tables, features, **kw).stack("stack_64")
  assert stack.plan.placement.skews == (1.1, 0.0)
  assert stack.num_unique is not None
  lookups = 1024 // 8 * 9
  assert stack.plan.update_capacity(lookups) == stack.plan.capacity_for(stack.num_unique)
  uniform = plan_collection([dataclasses.replace(t, id_skew=0.0) for t in tables], features,
                            **kw).stack("stack_64")
  assert uniform.num_unique is None   # uniform ids over 25,000 rows repeat too little to pay
  assert stack.bytes_moved_update < uniform.bytes_moved_update
  with pytest.raises(TypeError, match=r"num_unique takes a capacity by table .* 'auto'"):
    plan_collection(tables, features, mesh={"batch": 8}, num_unique="auto")


def test_auto_dedup_routes_distinct_ids_where_it_pays_and_matches_reference():
  from embedlib.plan import hlo
  mesh = jax.make_mesh((8,), ("batch",))
  batch = 64
  build = lambda **kw: EmbeddingCollection(DEDUP_TABLES, DEDUP_FEATURES, mesh=mesh,
                                           batch_size=batch, rngs=nnx.Rngs(0), **kw)
  # Only ``coll`` runs; the others are read for their plans (built abstract).
  shaped = lambda **kw: nnx.eval_shape(lambda: build(**kw))
  coll, plain = build(), shaped(num_unique=None)
  assert coll.plan["few"].num_unique is not None and coll.plan["few"].num_unique < 64
  assert coll.plan["many"].num_unique is None
  stack = coll.plan.stack("stack_64")
  assert stack.num_unique is not None and stack.num_unique < 64
  assert coll.num_unique == {"few": coll.plan["few"].num_unique, "stack_64": stack.num_unique}
  assert plain.num_unique == {} and coll.plan.bytes_moved < plain.plan.bytes_moved
  # The sparse update routes the same distinct ids: at the dedup's capacity,
  # though its placement counts distinct ids and the update's step counts lookups.
  lookups = batch // 8 * 8  # "t" alone: 8 samples of 8 ids a shard
  assert stack.plan.placement.lookups is not None
  assert stack.plan.update_capacity(lookups) == stack.plan.capacity_for(stack.num_unique)
  assert plain.plan.stack("stack_64").plan.placement.lookups is None
  # "error" raises on overflow: only a capacity the caller gave may.
  assert shaped(on_overflow="error").num_unique == {}
  assert shaped(on_overflow="error", num_unique={"few": 30}).num_unique == {"few": 30}
  rng = np.random.default_rng(3)
  shape = {"f_few": (batch, 8), "f_many": (batch, 2), "f_t": (batch, 8)}
  rows = {t.name: t.num_embeddings for t in DEDUP_TABLES}
  inputs = {f.name: rng.integers(-1, rows[f.table] + 1, shape[f.name]) for f in DEDUP_FEATURES}
  # Split over the data axes as a training step's batch is: outputs stay split.
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
  x = {k: jax.device_put(jnp.asarray(v), split) for k, v in inputs.items()}
  tables = {t.name: jnp.asarray(np.asarray(coll.logical_table(t.name))) for t in DEDUP_TABLES}
  got, grads, want, want_grads = check.outputs_and_gradients(
      coll, lambda m: m(x), tables, DEDUP_FEATURES, inputs, {}, seed=4)
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6,
                               err_msg=k)
  got_grads = table_grads(coll, grads)
  for t in DEDUP_TABLES:
    np.testing.assert_allclose(got_grads[t.name][:, : t.features], want_grads[t.name],
                               rtol=1e-5, atol=1e-6, err_msg=t.name)
  # The planner's bytes, dedup included, are what the compiled lookup moves.
  graphdef, state = nnx.split(coll)
  compiled = hlo.bytes_moved(jax.jit(lambda s: nnx.merge(graphdef, s)(x)).lower(state)
                             .compile().as_text())
  assert abs(compiled - coll.plan.bytes_moved) <= 0.10 * compiled, (compiled, coll.plan.bytes_moved)
