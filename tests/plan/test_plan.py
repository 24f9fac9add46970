"""The planner: defaults, the auto rule, padding, costs and its errors."""

import pytest

from embedlib import plan_embedding
from embedlib.plan import cost, resolve_axes

TP = {"data": 2, "model": 4}
RECSYS = {"batch": 8}
FSDP_TP = {"fsdp": 2, "tensor": 4}


@pytest.mark.parametrize(
    "mesh, table_axes, data_axes",
    [
        (TP, ("model",), ("data",)),
        (RECSYS, ("batch",), ("batch",)),
        ({"replica": 2, "batch": 8}, ("replica", "batch"), ("replica", "batch")),
        ({"x": 4}, ("x",), ()),
        ({}, (), ()),
    ],
)
def test_default_axes(mesh, table_axes, data_axes):
  assert resolve_axes(mesh) == (table_axes, data_axes)


@pytest.mark.parametrize(
    "vocab, width, mesh, kwargs, strategy, phrase",
    [
        (50257, 768, TP, {}, "hidden", "fewest bytes"),
        (50257, 768, TP, {"tied": True}, "vocab", "tied"),
        (1_000_000, 100, RECSYS, {}, "hidden", "fewest bytes"),  # seed 000's width
        (1_000_000, 3, RECSYS, {}, "routed", "too narrow"),
        (1_000_000, 1, RECSYS, {}, "routed", "too narrow"),  # Wide & Deep's width 1
        # The table: 64 ranks of 8192 ids each; hidden has 2 columns a rank.
        (10_000_000, 128, {"batch": 64}, {"ids_per_device": 8192}, "routed", "fewest bytes"),
        (10_000_000, 128, {"batch": 8}, {"ids_per_device": 8192}, "hidden", "fewest bytes"),
        (4, 1 << 20, RECSYS, {}, "hidden", "smaller than the table group"),
        (99, 16, TP, {}, "replicated", "small table"),
        (1_000_000, 64, {"batch": 1}, {}, "replicated", "one device"),
        (1_000_000, 64, None, {}, "replicated", "one device"),
        (1000, 64, TP, {"sharding": "vocab"}, "vocab", "requested"),
    ],
)
def test_auto_rule(vocab, width, mesh, kwargs, strategy, phrase):
  plan = plan_embedding(vocab, width, mesh=mesh, **kwargs)
  assert plan.strategy == strategy
  assert phrase in plan.reason


def test_padding_and_shapes():
  plan = plan_embedding(50257, 768, mesh={"model": 8}, sharding="vocab")
  assert plan.padded_shape == (50264, 768)
  assert plan.shard_shape == (6283, 768)
  assert plan.padding_overhead == pytest.approx(7 / 50257)
  assert plan.bytes_per_device == 6283 * 768 * 4
  assert plan.table_spec == (("model",), None)
  hidden = plan_embedding(10, 100, mesh={"batch": 8}, sharding="hidden")
  assert hidden.padded_shape == (10, 104) and hidden.table_spec == (None, ("batch",))


def test_token_axes_come_first():
  """Column blocks must be ordered token axes first for the all_to_all."""
  plan = plan_embedding(1000, 64, mesh=TP, sharding="hidden",
                        table_axes=("model", "data"), data_axes=("data",))
  assert plan.table_axes == ("data", "model")
  assert plan.token_axes == ("data",) and plan.rest_axes == ("model",)


def test_hidden_moves_fewer_bytes_than_vocab():
  kw = dict(mesh=TP, ids_per_device=2048)
  vocab = plan_embedding(50257, 768, sharding="vocab", **kw)
  hidden = plan_embedding(50257, 768, sharding="hidden", **kw)
  replicated = plan_embedding(50257, 768, sharding="replicated", **kw)
  assert replicated.bytes_moved_per_lookup == 0
  assert 0 < hidden.bytes_moved_per_lookup < vocab.bytes_moved_per_lookup
  # all-gather of [2048 tokens, 192 cols] from 3 other ranks
  assert hidden.bytes_moved_per_lookup == 3 * 2048 * 192 * 4
  assert cost.ID_BYTES == 4


@pytest.mark.parametrize("devices", [8, 16, 64])
def test_routed_moves_about_the_rows_a_device_needs(devices):
  """The issue's table: vocab receives a row for every id of the group, routed about its own."""
  kw = dict(mesh={"batch": devices}, ids_per_device=8192)
  routed = plan_embedding(10_000_000, 128, sharding="routed", **kw)
  vocab = plan_embedding(10_000_000, 128, sharding="vocab", **kw)
  needed = 8192 * 128 * 4
  assert routed.bytes_moved_per_lookup <= 1.5 * needed
  assert vocab.bytes_moved_per_lookup >= (devices - 1) * needed
  capacity = routed.capacity_for(8192)
  assert 8192 / devices < capacity < 1.5 * 8192 / devices
  assert routed.bytes_moved_per_lookup == cost.route_bytes(capacity, devices, 128, 4)
  pinned = plan_embedding(10_000_000, 128, sharding="routed", route_capacity=300, **kw)
  assert pinned.capacity_for(8192) == 300 and "route capacity  300" in str(pinned)


@pytest.mark.parametrize("rows, sharding, mesh, ids, way", [
    (100, "replicated", RECSYS, 512, "allreduce"),  # every row's sum: fewer than the pairs
    (1 << 16, "replicated", RECSYS, 8, "gather"),  # a few pairs: fewer than the rows
    (1 << 16, "hidden", RECSYS, 512, "gather"),
    (1 << 16, "routed", RECSYS, 512, "route"),
    (1 << 16, "vocab", TP, 512, "gather"),  # the model ranks hold the same ids: no route
    (1 << 16, "vocab", {"x": 4}, 512, "none"),  # no data axes: no other rank's gradients
])
def test_sparse_update_takes_the_way_that_moves_fewest_bytes(rows, sharding, mesh, ids, way):
  p = plan_embedding(rows, 64, mesh=mesh, sharding=sharding)
  got, moved = p.sparse_update(ids)
  shards = p.data_shards
  ways = {"none": 0, "gather": cost.gather_pairs_bytes(ids, shards, 64, 4),
          "allreduce": cost.allreduce_bytes(rows, shards, 64),
          "route": cost.routed_pairs_bytes(p.capacity_for(ids), p.group_size, 1, 64, 4)}
  assert (got, moved) == (way, ways[way])
  assert moved <= ways["gather"] or way == "none"


def test_summary_prints_every_field():
  text = str(plan_embedding(50257, 768, mesh=TP, tied=True, name="tokens"))
  for field in ("tokens: 50257 x 768", "vocab", "model=4", "50260 x 768",
                "bytes/device", "moved/lookup", "reason"):
    assert field in text
  text = str(plan_embedding(1_000_000, 100, mesh=RECSYS))  # hidden: full-width gradients
  assert "moved/update    1.38 MiB per device, the sparse optimizers' all-gather" in text


@pytest.mark.parametrize(
    "args, kwargs, error, words",
    [
        ((0, 8), {}, ValueError, ["num_embeddings", ">= 1"]),
        ((8, -1), {}, ValueError, ["features", ">= 1"]),
        ((8.0, 8), {}, TypeError, ["num_embeddings", "int"]),
        ((8, 8), {"sharding": "rows"}, ValueError, ["'rows'", "vocab"]),
        ((8, 8), {"mesh": TP, "table_axes": ("tensor",)}, ValueError,
         ["'tensor'", "('data', 'model')"]),
        ((8, 8), {"mesh": TP, "data_axes": ("data", "data")}, ValueError,
         ["more than once"]),
        ((8, 8), {"mesh": TP, "table_axes": 3}, TypeError, ["table_axes"]),
        ((8, 8), {"mesh": [2, 4]}, TypeError, ["jax.make_mesh"]),
        ((8, 8), {"mesh": RECSYS, "sharding": "routed", "route_capacity": 0}, ValueError,
         ["route_capacity=0", "one id per destination", "8 ranks", "route_capacity >= 1"]),
        ((8, 8), {"mesh": FSDP_TP, "sharding": "grid", "table_axes": "tensor",
                  "column_axes": "tensor"}, ValueError,
         ["'tensor'", "both table_axes", "column_axes", "name it on one"]),
        ((8, 8), {"mesh": {"tensor": 4}, "sharding": "grid"}, ValueError,
         ["sharding='grid'", "column_axes=()", "pass both"]),
        ((8, 8), {"mesh": FSDP_TP, "sharding": "vocab", "column_axes": "fsdp"}, ValueError,
         ["column_axes='fsdp'", "sharding='grid'"]),
        ((8, 8), {"mesh": FSDP_TP, "sharding": "grid", "column_axes": "expert"}, ValueError,
         ["'expert'", "('fsdp', 'tensor')"]),
        ((1 << 20, 256), {"mesh": FSDP_TP, "device_memory_bytes": 64 << 20}, ValueError,
         ["no layout fits", "64.00 MiB", "grid 13", "optimizer slots", "more devices"]),
    ],
)
def test_errors_name_the_thing_and_the_fix(args, kwargs, error, words):
  with pytest.raises(error) as info:
    plan_embedding(*args, name="user_id", **kwargs)
  message = str(info.value)
  assert "user_id" in message
  for word in words:
    assert word in message


def test_grid_shapes_costs_and_summary():
  """Rows over tensor and columns over fsdp, each padded to its own group."""
  p = plan_embedding(50257, 100, mesh={"fsdp": 2, "tensor": 4}, sharding="grid", name="tok")
  assert (p.table_axes, p.column_axes, p.data_axes) == (("tensor",), ("fsdp",), ("fsdp",))
  assert p.padded_shape == (50260, 100) and p.shard_shape == (12565, 50)
  assert p.table_spec == (("tensor",), ("fsdp",))
  assert p.bytes_per_device == 12565 * 50 * 4
  vocab = plan_embedding(50257, 100, mesh={"fsdp": 2, "tensor": 4}, sharding="vocab")
  assert p.bytes_per_device * 2 == vocab.bytes_per_device
  # The vocab lookup of a half-width block for both fsdp ranks' ids, then an
  # all-to-all of the halves: the same psum bytes as vocab, plus the exchange.
  assert p.bytes_moved_per_lookup > vocab.bytes_moved_per_lookup
  assert p.sparse_update(512)[0] == "gather"
  text = str(p)
  for field in ("strategy        grid", "column_axes     ('fsdp',)", "50260 x 100",
                "12565 x 50"):
    assert field in text


def test_auto_takes_a_grid_only_where_no_1d_layout_fits():
  mesh = {"fsdp": 2, "tensor": 4}
  roomy = plan_embedding(1 << 20, 256, mesh=mesh, device_memory_bytes=1 << 30)
  assert roomy.strategy != "grid"
  tight = plan_embedding(1 << 20, 256, mesh=mesh, device_memory_bytes=200 << 20, name="t")
  assert tight.strategy == "grid" and tight.bytes_per_device == 128 << 20
  assert "doesn't fit device_memory_bytes" in tight.reason
  tied = plan_embedding(1 << 20, 256, mesh=mesh, tied=True, device_memory_bytes=200 << 20)
  assert tied.strategy == "grid"
  # No data axis outside the table group: no grid to fall back to.
  with pytest.raises(ValueError, match="no layout fits"):
    plan_embedding(1 << 20, 256, mesh={"model": 4}, device_memory_bytes=200 << 20)
