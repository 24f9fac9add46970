"""Row gradients routed to their owners update exactly as the all-gather does, moving less.

The all-gather path (every rank sees every rank's pairs) is the reference
here: ``tests/optim/test_rules.py`` checks it against the dense rules on
every layout. Routing sums each rank's duplicates first, so sums are added
in another order: float32, ``rtol=1e-5``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import optim
from embedlib.optim import route
from embedlib.plan import hlo
from tests import covering

LAYOUTS = {
    "8-tokens": (((8,), ("batch",)), {}),
    "4x2-both": (((4, 2), ("data", "model")), {"table_axes": ("data", "model")}),
    "2x4-replica": (((2, 4), ("replica", "batch")), {"table_axes": ("batch",)}),
}


def _setup(layout, strategy, capacity=None, rows=1000, **kw):
  (shape, names), axes = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])
  emb = embedlib.ShardedEmbed(rows, 16, mesh=mesh, sharding=strategy, route_capacity=capacity,
                              rngs=nnx.Rngs(0), **axes, **kw)
  rng = np.random.default_rng(1)
  ids = rng.integers(-1, rows + 3, (8 * 48,)).astype(np.int32)
  ids[:40] = 7  # a hot id, repeated across ranks
  pairs = [(ids, rng.standard_normal((ids.size, 16)).astype(np.float32)),
           (ids[:64].reshape(16, 4), rng.standard_normal((16, 4, 16)).astype(np.float32))]
  return emb, pairs


def _step(emb, rule, pairs):
  slots = optim.init_slots(rule, emb.plan, emb.mesh)
  fn = jax.jit(lambda t, s, p: optim.apply_row_grads(rule, t, s, p, plan=emb.plan,
                                                     mesh=emb.mesh, step=0))
  table, slots = fn(emb.physical_table(), slots, pairs)
  return np.asarray(table), {k: np.asarray(v) for k, v in slots.items()}, fn, slots


# Capacity None: the plan's (the route); 1 overflows (the fallback). Every
# layout with every strategy, and each with both capacities, in CI (6
# cases, tests/covering.py); -m slow runs the whole product.
@pytest.mark.parametrize("layout, strategy, capacity",
                         covering.params(list(LAYOUTS), ["routed", "vocab"], [None, 1]))
def test_routed_update_equals_the_all_gather(layout, strategy, capacity, monkeypatch):
  emb, pairs = _setup(layout, strategy, capacity)
  local_ids = (pairs[0][0].size + pairs[1][0].size) // emb.plan.data_shards
  assert route.pays(emb.plan, local_ids, 4)
  # A capacity of every id a rank holds moves as much as the all-gather.
  every = _setup(layout, strategy, capacity=local_ids)[0].plan
  assert not route.pays(every, local_ids, 4)
  rule = optim.RowWiseAdagrad(0.1)
  table, slots, _, _ = _step(emb, rule, pairs)
  monkeypatch.setattr(route, "pays", lambda *a: False)
  want_table, want_slots, _, _ = _step(emb, rule, pairs)
  np.testing.assert_allclose(table, want_table, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(slots["acc"], want_slots["acc"], rtol=1e-5, atol=1e-6)
  assert (table != np.asarray(emb.physical_table())).any()


@pytest.fixture(scope="module")
def flat_update():
  emb, pairs = _setup("8-tokens", "routed", rows=200)
  return _step(emb, optim.RowWiseAdagrad(0.1), pairs)[:2]


# 2 nodes of 4; 4 of 2 with a node capacity of 1, every round crowded (the
# flat buffers across). A row's gradients from a node's ranks are summed
# there before crossing: another order of float sums, rtol 1e-5.
@pytest.mark.parametrize("nodes", [dict(devices_per_node=4),
                                   dict(devices_per_node=2, node_capacity=1)],
                         ids=["2-nodes-of-4", "4-nodes-of-2-crowded"])
def test_the_update_across_nodes_equals_the_flat_route(nodes, flat_update):
  emb, pairs = _setup("8-tokens", "routed", rows=200, **nodes)
  assert emb.plan.node_update and route.pays(emb.plan, 56, 4)
  table, slots, _, _ = _step(emb, optim.RowWiseAdagrad(0.1), pairs)
  np.testing.assert_allclose(table, flat_update[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(slots["acc"], flat_update[1]["acc"], rtol=1e-5, atol=1e-6)


def test_routed_update_moves_less_than_the_all_gather(monkeypatch):
  emb, pairs = _setup("8-tokens", "routed", rows=100_000)
  rule = optim.SparseSGD(0.1)
  compiled = lambda: hlo.bytes_moved(jax.jit(
      lambda t, p: optim.apply_row_grads(rule, t, {}, p, plan=emb.plan, mesh=emb.mesh, step=0)
  ).lower(emb.physical_table(), pairs).compile().as_text())
  routed = compiled()
  monkeypatch.setattr(route, "pays", lambda *a: False)
  gathered = compiled()
  entry = 4 + 16 * 4  # an id and its row gradient
  local = (8 * 48 + 64) // 8
  assert gathered == 7 * local * entry
  capacity = emb.plan.capacity_for(local)
  # Two all-to-alls, the round's bounds (pmin of [8] int32) and "another round" (pmax).
  assert routed == 7 * capacity * entry + 2 * 7 * 8 * 4 // 8 + 7
  assert routed < gathered / 3
  # The plan's estimate (what the collection's planner weighs) leaves out
  # only the rounds' few scalars.
  assert emb.plan.sparse_update(local) == ("route", 7 * capacity * entry)


def test_routed_update_never_copies_the_table(update_path):
  # The rounds are a while loop carrying the table and slots: a cond around
  # the update gave each branch its own output buffers, a copy of the donated
  # table and slots every step.
  emb, pairs = _setup("8-tokens", "routed", rows=100_000)
  rule = optim.RowWiseAdagrad(0.1)
  slots = optim.init_slots(rule, emb.plan, emb.mesh)
  text = jax.jit(
      lambda t, s, p: optim.apply_row_grads(rule, t, s, p, plan=emb.plan, mesh=emb.mesh, step=0),
      donate_argnums=(0, 1),
  ).lower(emb.physical_table(), slots, pairs).compile().as_text()
  rows = emb.physical_table().shape[0] // 8
  assert " while(" in text  # the rounds are there
  copies = re.findall(rf"= f32\[{rows}(?:,16)?\]\S* copy\(", text)
  assert not copies, copies


@pytest.mark.parametrize("rule", [optim.SparseSGD(0.1), optim.RowWiseAdagrad(0.1)],
                         ids=["sgd", "adagrad"])
def test_routed_update_scratch_is_sized_by_the_route(rule, monkeypatch):
  # Every round's buffers hold group * capacity entries (an id and its row
  # gradient): sent, received, and the update's dedup of what arrived. The
  # all-gather's pairs alone are data_shards * ids entries, 3.3x more here.
  emb, pairs = _setup("8-tokens", "routed", rows=100_000)
  slots = optim.init_slots(rule, emb.plan, emb.mesh)
  temp = lambda: jax.jit(
      lambda t, s, p: optim.apply_row_grads(rule, t, s, p, plan=emb.plan, mesh=emb.mesh, step=0),
      donate_argnums=(0, 1),
  ).lower(emb.physical_table(), slots, pairs).compile().memory_analysis().temp_size_in_bytes
  entry = 4 + 16 * 4
  local = (8 * 48 + 64) // 8
  slots_per_round = 8 * emb.plan.capacity_for(local)
  routed = temp()
  assert routed <= 3 * slots_per_round * entry, routed
  monkeypatch.setattr(route, "pays", lambda *a: False)
  gathered = temp()
  assert gathered >= 8 * local * entry > 3 * slots_per_round * entry, gathered


def test_the_update_routes_distinct_rows_and_overflows_into_rounds(monkeypatch):
  # 512 rows over 8 owners, 200 ids a rank: the update's capacity counts the
  # distinct ids uniform draws give (about 166), not 200 lookups a rank.
  mesh = jax.make_mesh((8,), ("batch",))
  emb = embedlib.ShardedEmbed(512, 16, mesh=mesh, sharding="routed", rngs=nnx.Rngs(0))
  n = 200
  capacity = emb.plan.update_capacity(n)
  assert capacity < emb.plan.capacity_for(n)
  small = embedlib.ShardedEmbed(12, 16, mesh=mesh, sharding="routed", rngs=nnx.Rngs(0)).plan
  assert small.update_capacity(n) <= 12 < small.capacity_for(n)  # a row once, not per lookup
  # Skewed against it: every rank's ids on owner 0's 64 rows, more distinct
  # ones than the capacity, so the step takes rounds; the all-gather's update all the same.
  rng = np.random.default_rng(3)
  ids = rng.integers(0, 64, (8 * n,)).astype(np.int32)
  assert min(len(set(ids[r * n:(r + 1) * n])) for r in range(8)) > capacity
  pairs = [(ids, rng.standard_normal((ids.size, 16)).astype(np.float32))]
  rule = optim.LazyAdam(0.1)
  table, slots, _, _ = _step(emb, rule, pairs)
  monkeypatch.setattr(route, "pays", lambda *a: False)
  want_table, want_slots, _, _ = _step(emb, rule, pairs)
  np.testing.assert_allclose(table, want_table, rtol=1e-5, atol=1e-6)
  for name in want_slots:
    np.testing.assert_allclose(slots[name], want_slots[name], rtol=1e-5, atol=1e-6)


def test_sum_duplicates():
  ids = jnp.array([5, 5, -1, 2, 5])
  unique, sums = route.sum_duplicates(ids, jnp.arange(10.0).reshape(5, 2))
  assert unique.tolist() == [2, 5, -1, -1, -1]
  assert sums.tolist() == [[6.0, 7.0], [10.0, 13.0], [0, 0], [0, 0], [0, 0]]
