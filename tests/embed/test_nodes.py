"""The two-level route over nodes equals one device; its exchanges stay inside a node, then cross.

8 simulated devices as nodes (``devices_per_node``): 2 nodes of 4, and 4
nodes of 2 with a node capacity of 1, so that every step crosses with the
flat route's buffers (``crowded``) and must still be exact. Lookups are
exact; the gradient sums a node's repeats before crossing, in another
order than one device: 1e-5 relative (f32).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import embedlib
from embedlib.plan import hlo, mesh_axes, plan_embedding

ROWS, FEATURES = 99, 16
CASES = {
    "2-nodes-of-4": dict(devices_per_node=4),
    "4-nodes-of-2-crowded": dict(devices_per_node=2, node_capacity=1),
}
WITHIN = {(0, 1, 2, 3), (4, 5, 6, 7)}
ACROSS = {(0, 4), (1, 5), (2, 6), (3, 7)}


def _ids(mesh):
  ids = np.random.default_rng(0).integers(-1, 60, (32, 3)).astype(np.int32)
  ids[::5, 0] = 7  # a hot id, asked by every rank
  return jax.device_put(ids, NamedSharding(mesh, P("batch")))


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
  mesh = jax.make_mesh((8,), ("batch",))
  # A capacity of every id a rank holds: the route itself runs, never vocab's.
  emb = embedlib.ShardedEmbed(ROWS, FEATURES, mesh=mesh, sharding="routed", route_capacity=64,
                              rngs=nnx.Rngs(0), **CASES[request.param])
  graphdef, state = nnx.split(emb)
  lookup = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))
  return request.param, emb, lookup, state, _ids(mesh)


def test_lookup_and_its_gradient_equal_one_device(case):
  _, emb, _, state, ids = case
  assert emb.plan.node_route
  table = np.asarray(emb.logical_table())
  idn = np.asarray(ids)
  want = np.where((idn >= 0)[..., None], table[np.clip(idn, 0, ROWS - 1)], 0.0)
  scale = jnp.linspace(-1.0, 2.0, FEATURES)
  loss = lambda rows: jnp.sum(rows ** 2 * scale)
  # One program: the lookup, and the gradient through its transpose.
  out, grads = nnx.jit(lambda m: nnx.value_and_grad(lambda m: (loss(m(ids)), m(ids)),
                                                    has_aux=True)(m))(emb)
  np.testing.assert_array_equal(np.asarray(out[1]), want)
  one = jnp.asarray(idn)  # on one device
  reference = lambda t: jnp.where((one >= 0)[..., None],
                                  jnp.take(t, jnp.maximum(one, 0), axis=0), 0)
  expected = jax.grad(lambda t: loss(reference(t)))(jnp.asarray(table))
  physical = np.asarray(grads.embedding.get_raw_value())
  np.testing.assert_allclose(physical[:ROWS], expected, rtol=1e-5, atol=1e-5)
  assert not physical[ROWS:].any()


def test_the_exchanges_stay_inside_a_node_then_cross(case):
  name, emb, lookup, state, ids = case
  if name != "2-nodes-of-4":
    pytest.skip("one layout's HLO")
  text = lookup.lower(state, ids).compile().as_text()
  groups = [hlo.replica_groups(line) for line in text.splitlines() if " all-to-all(" in line]
  # Ids and rows, each inside the node and across (the crowded branch's two
  # across too): never one over the whole group.
  assert {tuple(map(tuple, g)) for g in groups} == {tuple(sorted(WITHIN)), tuple(sorted(ACROSS))}
  assert sum(set(map(tuple, g)) == WITHIN for g in groups) == 2
  # The cost model's split is what XLA compiled (the uncrowded branch).
  ids_per_device = ids.size // 8
  assert (hlo.bytes_moved(text) - hlo.inter_node_bytes(text, 4),
          hlo.inter_node_bytes(text, 4)) == emb.plan.node_bytes(ids_per_device)


def test_one_node_is_the_flat_route():
  mesh = jax.make_mesh((8,), ("batch",))
  ids = _ids(mesh)
  texts = []
  for per in (None, 8):
    emb = embedlib.ShardedEmbed(ROWS, FEATURES, mesh=mesh, sharding="routed",
                                devices_per_node=per, rngs=nnx.Rngs(0))
    assert not emb.plan.node_route and emb.plan.nodes == 1
    assert emb.plan.node_bytes() == (emb.plan.bytes_moved_per_lookup, 0)
    graphdef, state = nnx.split(emb)
    texts.append(jax.jit(lambda s, i: nnx.merge(graphdef, s)(i)).lower(state, ids).as_text())
  assert texts[0] == texts[1]


def test_a_devices_per_node_that_does_not_divide_the_group_is_named():
  with pytest.raises(ValueError, match=r"items: devices_per_node=3 doesn't divide the table "
                                       r"group of 8 devices .* pass one of \[1, 2, 4, 8\]"):
    plan_embedding(1000, 16, mesh={"batch": 8}, sharding="routed", devices_per_node=3,
                   name="items")


def test_devices_per_node_is_read_from_the_devices():
  def mesh(processes):
    devices = np.array([types.SimpleNamespace(process_index=p) for p in processes])
    return types.SimpleNamespace(devices=devices.reshape(2, 4), axis_names=("data", "model"),
                                 shape={"data": 2, "model": 4})
  two_hosts = mesh([0, 0, 1, 1, 2, 2, 3, 3])
  assert mesh_axes.devices_per_node(two_hosts, ("model",)) == 2
  assert mesh_axes.devices_per_node(two_hosts, ("data", "model")) == 2
  assert mesh_axes.devices_per_node(mesh([0] * 4 + [1] * 4), ("model",)) is None  # one node
  assert mesh_axes.devices_per_node(mesh([0] * 8), ("data", "model")) is None


def test_the_plan_splits_its_bytes_and_auto_weighs_those_across_nodes():
  flat = plan_embedding(20_000, 128, mesh={"batch": 16}, ids_per_device=4096)
  nodes = plan_embedding(20_000, 128, mesh={"batch": 16}, ids_per_device=4096,
                         devices_per_node=8)
  # Each node asks for most of a destination's 1,250 rows: once per node pair
  # it is cheaper than hidden's all-gather across nodes.
  assert (flat.strategy, nodes.strategy) == ("hidden", "routed")
  assert "a byte across nodes counted 8x" in nodes.reason
  intra, inter = nodes.node_bytes()
  assert intra + inter == nodes.bytes_moved_per_lookup
  printed = " ".join(str(nodes).split())
  assert (f"across nodes {inter / 1024:.2f} KiB per lookup per device "
          f"({intra / 2**20:.2f} MiB inside its node of 8; 2 nodes, two-level route)") in printed
  routed = plan_embedding(20_000, 128, mesh={"batch": 16}, ids_per_device=4096,
                          sharding="routed", devices_per_node=8)
  flat_routed = plan_embedding(20_000, 128, mesh={"batch": 16}, ids_per_device=4096,
                               sharding="routed")
  assert routed.node_bytes()[1] < flat_routed.bytes_moved_per_lookup / 4


def test_the_plan_keeps_the_flat_route_where_two_levels_do_not_pay():
  # Uniform ids over 7,813 rows a rank: a node's 8 x 173 ids per owner hold
  # about 1,263 distinct ones, too few repeats to pay for the extra hop.
  kw = dict(mesh={"batch": 64}, sharding="routed", ids_per_device=8192, devices_per_node=8)
  uniform = plan_embedding(500_000, 64, **kw)
  assert uniform.nodes == 8 and not uniform.node_route and not uniform.node_update
  assert "two-level" not in str(uniform)
  skewed = plan_embedding(500_000, 64, node_capacity=400, **kw)  # ids that repeat more
  assert skewed.node_route and skewed.node_update
  assert skewed.node_bytes()[1] < uniform.node_bytes()[1] / 3
