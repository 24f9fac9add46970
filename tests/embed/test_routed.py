"""The routed strategy: both of its paths (the route, the overflow fallback) equal the reference.

``on_overflow="error"`` makes a call that would fall back raise instead, so a
call that returns under it took the route: the tests use it to pin down
which path produced the rows they compare. Tolerances: lookups are exact;
pooled bags and gradients sum in another order, 1e-5 relative (f32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

from embedlib.strategies import unique
from tests.embed.contract import build, check_contract, make_mesh, random_case

MESHES = {
    "8-tokens": ((8,), ("batch",), None, None),
    "3-tokens": ((3,), ("batch",), None, None),
    "2x4-tp": ((2, 4), ("data", "model"), None, None),
    "4x2-mixed": ((4, 2), ("data", "model"), ("model", "data"), ("data",)),
    "2x4-replica": ((2, 4), ("replica", "batch"), ("batch",), None),
}


def _emb(mesh_name, size=(99, 20), **kw):
  shape, names, table_axes, data_axes = MESHES[mesh_name]
  return build(*size, make_mesh(shape, names), sharding="routed", table_axes=table_axes,
               data_axes=data_axes, **kw)


def _checked_call(emb, ids):
  graphdef, state = nnx.split(emb)
  return checkify.checkify(jax.jit(lambda s, i: nnx.merge(graphdef, s)(i)))(state, ids)


# The overflow fallback (capacity 1) on every mesh. The plan's capacity on
# every mesh is test_contract.py's routed layouts (all nine meshes, at
# other sizes). CI runs each mesh once: the plan's capacity on 8-tokens,
# the fallback on the others (and on 8-tokens in
# test_pooled_bags_and_their_gradient); -m slow runs both on every mesh.
@pytest.mark.parametrize("mesh_name, capacity", [
    pytest.param(m, c, id=f"{c}-{m}",
                 marks=pytest.mark.slow if (c is None) != (m == "8-tokens") else ())
    for c in (None, 1) for m in MESHES])
def test_both_paths_match_the_reference(mesh_name, capacity):
  emb = _emb(mesh_name, route_capacity=capacity)
  check_contract(emb, *random_case(99, 20, batch=11))


@pytest.mark.parametrize("mesh_name", ["8-tokens", "2x4-tp", "4x2-mixed"])
def test_the_route_itself_matches_the_reference(mesh_name):
  """A capacity of every id a rank holds can't overflow: the route runs, checked."""
  emb = _emb(mesh_name, route_capacity=64, on_overflow="error")
  ids, query = random_case(99, 20, batch=11)
  err, out = _checked_call(emb, ids)
  assert jax.device_get(err).get() is None
  table = np.asarray(emb.logical_table())
  expected = np.where((np.asarray(ids) >= 0)[..., None] & (np.asarray(ids) < 99)[..., None],
                      table[np.clip(np.asarray(ids), 0, 98)], 0.0)
  np.testing.assert_array_equal(np.asarray(out), expected)
  # The same capacity can't overflow, so the route also runs under plain jit.
  emb.on_overflow = "fallback"
  check_contract(emb, ids, query)


def test_overflow_raises_naming_the_table_and_the_count():
  emb = _emb("8-tokens", route_capacity=1, on_overflow="error", name="items")
  ids = jnp.zeros((16, 4), jnp.int32)  # every id owned by rank 0
  with pytest.raises(ValueError, match=r"table 'items': a rank sends 8 ids to one owner, "
                                       r"more than route_capacity=1; pass route_capacity"):
    emb(ids)
  err, _ = _checked_call(emb, ids)
  with pytest.raises(checkify.JaxRuntimeError, match="route_capacity=1"):
    jax.device_get(err).throw()


# Every mesh with both capacities (the route, and its fallback when a bucket
# overflows) and every combiner with both: the combiner is applied after the
# rows come back, so it is independent of the mesh.
@pytest.mark.parametrize("mesh_name,combiner,capacity", [
    ("8-tokens", "sum", 64), ("8-tokens", "mean", 1),
    ("2x4-replica", "sqrtn", 64), ("2x4-replica", "sum", 1),
    ("4x2-mixed", "mean", 64), ("4x2-mixed", "sqrtn", 1),
])
def test_pooled_bags_and_their_gradient(mesh_name, combiner, capacity):
  emb = _emb(mesh_name, route_capacity=capacity)
  rng = np.random.default_rng(3)
  ids = jnp.asarray(rng.integers(-1, 101, (10, 4)), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.5, 2.0, (10, 4)), jnp.float32)
  table = jnp.asarray(np.asarray(emb.logical_table()))  # single-device reference

  def reference(t):
    valid = (ids >= 0) & (ids < 99)
    w = jnp.where(valid, weights, 0.0)
    rows = jnp.take(t, jnp.where(valid, ids, 0), axis=0) * w[..., None]
    pooled = rows.sum(1)
    denom = {"sum": jnp.ones(10), "mean": w.sum(1), "sqrtn": jnp.sqrt((w * w).sum(1))}[combiner]
    return jnp.where(denom[:, None] > 0, pooled / jnp.where(denom > 0, denom, 1.0)[:, None], 0.0)

  out = nnx.jit(lambda m: m.bag(ids, weights, combiner=combiner))(emb)
  np.testing.assert_allclose(out, reference(table), rtol=1e-5, atol=1e-6)
  scale = jnp.linspace(-1.0, 2.0, 20)
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m.bag(ids, weights, combiner=combiner) ** 2 * scale)))(emb)
  expected = jax.grad(lambda t: jnp.sum(reference(t) ** 2 * scale))(table)
  physical = np.asarray(grads.embedding.get_raw_value())
  np.testing.assert_allclose(physical[:99], expected, rtol=1e-5, atol=1e-5)
  assert not physical[99:].any()


def test_bucketize_gives_every_id_its_own_slot():
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(-1, 40, 200), jnp.int32)
  send, slot, need = unique.bucketize(ids, 5, 8, 40)
  ids, send, slot = map(np.asarray, (ids, send, slot))
  valid = ids >= 0
  assert int(need) == max(np.bincount(ids[valid] // 5, minlength=8))
  assert len(set(slot[valid])) == valid.sum() and (slot[~valid] == -1).all()
  np.testing.assert_array_equal(send[slot[valid]] + (slot[valid] // 40) * 5, ids[valid])
  assert (send[np.setdiff1d(np.arange(320), slot[valid])] == -1).all()
