"""``DynamicEmbed`` on 1, 4 and 8 devices equals the reference; raw ids; eval; bad input."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embedlib
from embedlib import dynamic
from embedlib.dynamic import reference as ref_lib
from tests.dynamic import helpers

DEEP = int(os.environ.get("EMBEDLIB_HYPOTHESIS_EXAMPLES", "0"))

POLICIES = {
    "lru": dict(eviction="lru"),
    "lfu_admit2": dict(eviction="lfu", admit_after=2, decay_every=2),
    "no_eviction": dict(eviction=None),
}


# CI runs each policy and each device count once: the richest policy on one
# device, the others on eight and on four (LFU over eight devices runs in
# CI in test_data_parallel_ids_on_a_mesh); ``-m slow`` adds the richest on
# four and on eight.
CASES = [("lfu_admit2", 1), pytest.param("lfu_admit2", 4, marks=pytest.mark.slow),
         pytest.param("lfu_admit2", 8, marks=pytest.mark.slow), ("lru", 8), ("no_eviction", 4)]


@pytest.mark.parametrize("policy,devices", CASES)
def test_mesh_equals_reference(devices, policy):
  emb = embedlib.DynamicEmbed(64, 4, bucket_size=8, mesh=helpers.mesh(devices),
                              rngs=nnx.Rngs(0), **POLICIES[policy])
  ref = ref_lib.Reference(emb.policy)
  table = helpers.ReferenceTable(64, 4, emb.init_key[...])
  for batch in helpers.draw_batches(3, 6, 20):
    rows = emb.rows_of(batch)
    want, placed = ref.step(ref_lib.as_uint64(batch))
    table.place(placed)
    assert np.asarray(rows).tolist() == want
    assert emb.stats() == pytest.approx(ref.stats)
  assert emb.resident() == ref.resident()
  # Each device holds only its own buckets' part of the map.
  assert emb.keys_hi[...].addressable_shards[0].data.shape == (64 // devices,)
  np.testing.assert_array_equal(np.asarray(emb.rows.embedding[...]), table.table)
  emb.eval()
  probe = helpers.POOL
  want = np.where(np.asarray(ref.lookup(ref_lib.as_uint64(probe)))[:, None] >= 0,
                  table.table[np.asarray(ref.lookup(ref_lib.as_uint64(probe)))], 0)
  np.testing.assert_array_equal(np.asarray(emb(probe)), want)


def test_uint64_past_2_32_with_x64_off():
  assert not jax.config.jax_enable_x64
  emb = embedlib.DynamicEmbed(128, 2, bucket_size=128, rngs=nnx.Rngs(0))
  ids = np.array([5, 2**32 + 5, 2**33 + 5, 2**64 - 2, 2**63 + 5], np.uint64)
  rows = np.asarray(emb.rows_of(ids))
  assert len(set(rows.tolist())) == 5 and (rows >= 0).all()
  assert set(emb.resident()) == {int(i) for i in ids}
  # The same ids as int64 (two's complement) are the same raw ids.
  np.testing.assert_array_equal(np.asarray(emb.rows_of(ids.view(np.int64))), rows)
  # Device ids: int32 -1 is padding, uint32 2**32 - 1 an id; both 5s are id 5.
  dev = emb.rows_of(jnp.array([-1, 5], jnp.int32))
  assert np.asarray(dev).tolist() == [-1, rows[0]]
  words = emb.rows_of(jnp.array([2**32 - 1], jnp.uint32))
  assert int(words[0]) >= 0 and int(words[0]) not in rows.tolist()


def test_words_inside_jit():
  emb = embedlib.DynamicEmbed(128, 2, bucket_size=128, rngs=nnx.Rngs(0))
  ids = np.array([[2**40 + 1, 7], [7, -1]], np.int64)

  @nnx.jit
  def look(emb, w):
    return emb.rows_of(w)

  rows = np.asarray(look(emb, dynamic.words(ids)))
  assert rows[0, 1] == rows[1, 0] and rows[0, 0] != rows[0, 1] and rows[1, 1] == -1
  assert int(emb.clock[...]) == 1 and len(emb.resident()) == 2


def _calls(jaxpr, name):
  """The jit calls named ``name`` in ``jaxpr``, at any depth: each one's program."""
  for eqn in jaxpr.eqns:
    if eqn.params.get("name") == name and "jaxpr" in eqn.params:
      yield eqn.params["jaxpr"]
    for param in eqn.params.values():
      for p in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(p, "jaxpr", p)
        if hasattr(inner, "eqns"):
          yield from _calls(inner, name)


def test_tables_alike_share_one_traced_map_step():
  """Tables that differ only by name trace the map's step once (its policy's name is a label)."""
  tables = [embedlib.DynamicEmbed(64, 4, bucket_size=8, mesh=helpers.mesh(4), name=name,
                                  rngs=nnx.Rngs(0)) for name in ("a", "b")]
  graphdef, state = nnx.split(tables)

  def step(state, ids):
    return [t(ids) for t in nnx.merge(graphdef, state)]

  ids = jnp.arange(8, dtype=jnp.int32)
  # mapping.run: the jit call named "run" around the map's shard_map.
  steps = [p for p in _calls(jax.make_jaxpr(step)(state, ids).jaxpr, "run")
           if any(e.primitive.name == "shard_map" for e in p.jaxpr.eqns)]
  assert len(steps) == 2 and steps[0] is steps[1]


def test_eval_does_not_admit():
  emb = embedlib.DynamicEmbed(128, 3, bucket_size=128, rngs=nnx.Rngs(0))
  seen = emb.rows_of(np.array([10, 11]))
  emb.eval()
  before = nnx.state(emb, dynamic.DynamicMap)
  out = emb(np.array([10, 12, 2**50]))
  assert np.asarray(emb.rows_of(np.array([12, 10]))).tolist() == [-1, int(seen[0])]
  np.testing.assert_array_equal(np.asarray(out[1:]), 0)
  after = nnx.state(emb, dynamic.DynamicMap)
  jax.tree.map(np.testing.assert_array_equal, before, after)
  emb.train()
  assert int(emb.rows_of(np.array([12]))[0]) >= 0


def test_learned_default_and_bag():
  emb = embedlib.DynamicEmbed(8, 2, bucket_size=8, admit_after=2, default="learned",
                              rngs=nnx.Rngs(0))
  emb.default_row[...] = jnp.array([1.0, -2.0])
  emb.rows_of(np.array([4, 4]))                  # 4 admitted (seen twice), 9 not yet
  emb.eval()
  one = np.asarray(emb(np.array([4, 9, -1])))
  np.testing.assert_array_equal(one[1], [1.0, -2.0])
  np.testing.assert_array_equal(one[2], [0.0, 0.0])
  ids = np.array([[4, 9, -1], [-1, -1, -1]])
  weights = np.array([[1.0, 3.0, 5.0], [1.0, 1.0, 1.0]], np.float32)
  got = np.asarray(emb.bag(ids, weights, combiner="mean"))
  np.testing.assert_allclose(got[0], (one[0] + 3 * one[1]) / 4, rtol=1e-6)
  np.testing.assert_array_equal(got[1], 0)
  np.testing.assert_allclose(np.asarray(emb.bag(ids, combiner="sqrtn"))[0],
                             (one[0] + one[1]) / np.sqrt(2), rtol=1e-6)


BAD = [
    (dict(capacity=100, bucket_size=128), ValueError, "multiple of bucket_size"),
    (dict(admit_after=0), ValueError, "admit_after=0"),
    (dict(eviction="fifo"), ValueError, "eviction='fifo'"),
    (dict(default="mean"), ValueError, "default='mean'"),
    # The default bucket size fits (16 rows a bucket here): a given one is checked.
    (dict(capacity=128, bucket_size=128, mesh=8), ValueError, "split evenly over the 8 devices"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_construction(kwargs, error, match):
  kwargs = {"capacity": 256, **kwargs}
  if "mesh" in kwargs:
    kwargs["mesh"] = helpers.mesh(kwargs["mesh"])
  with pytest.raises(error, match=f"users.*{match}|{match}") as info:
    embedlib.DynamicEmbed(kwargs.pop("capacity"), 4, name="users", rngs=nnx.Rngs(0), **kwargs)
  assert "users" in str(info.value)


def test_bad_ids():
  emb = embedlib.DynamicEmbed(128, 2, id_dtype="uint32", name="items", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="items: raw ids of dtype float32"):
    emb(np.array([1.0, 2.0], np.float32))
  with pytest.raises(TypeError, match="items: raw ids of dtype float32"):
    emb(jnp.array([1.0]))
  with pytest.raises(ValueError, match="items: raw id 1099511627776 lies outside.*uint32"):
    emb(np.array([2**40], np.int64))
  with pytest.raises(ValueError, match="items: raw id -5 lies outside"):
    emb(np.array([-5, 3]))
  with pytest.raises(ValueError, match="items: raw ids .* do not fit a 64-bit"):
    emb([2**70])
  assert emb.resident() == {}


@pytest.mark.parametrize("capacity", [None, 1], ids=["routed", "overflow_gathers"])
def test_data_parallel_ids_on_a_mesh(capacity):
  """Ids split over the group go to their owners (all-to-all); past the capacity, gathered."""
  mesh = helpers.mesh(8)
  emb = embedlib.DynamicEmbed(64, 4, bucket_size=8, mesh=mesh, route_capacity=capacity,
                              eviction="lfu", rngs=nnx.Rngs(0))
  ref = ref_lib.Reference(emb.policy)

  @nnx.jit
  def look(emb, w):
    return emb.rows_of(w), emb(w)

  for batch in helpers.draw_batches(11, 3, 32):
    w = dynamic.words(batch)
    w = dynamic.Words(jax.device_put(w.value, jax.NamedSharding(mesh, jax.P("x"))))
    with jax.set_mesh(mesh):
      rows, out = look(emb, w)
    assert np.asarray(rows).tolist() == ref.step(ref_lib.as_uint64(batch))[0]
    ref.step(ref_lib.as_uint64(batch))    # the second lookup of the step is one more step
  assert emb.resident() == ref.resident()
  assert out.shape == (32, 4) and rows.sharding.spec[0] == "x"


POLICY_POOL = [dict(eviction="lru"), dict(eviction="lfu", decay_every=2),
               dict(eviction=None, admit_after=2), dict(eviction="lru", admit_after=3),
               dict(eviction="lfu", admit_after=2, sketch_width=3)]


@settings(max_examples=DEEP or 2, deadline=None, derandomize=not DEEP, database=None,
          suppress_health_check=list(HealthCheck))
@given(policy=st.sampled_from(POLICY_POOL), devices=st.sampled_from([1, 4, 8]),
       buckets=st.sampled_from([8, 16]), bucket_size=st.sampled_from([2, 4]),
       seed=st.integers(0, 2**31 - 1), size=st.sampled_from([8, 24]))
def test_random_tables_equal_reference(policy, devices, buckets, bucket_size, seed, size):
  """Random policies, capacities, device counts and ids: rows, residents and stats exact."""
  emb = embedlib.DynamicEmbed(buckets * bucket_size, 2, bucket_size=bucket_size,
                              mesh=helpers.mesh(devices), rngs=nnx.Rngs(0), **policy)
  ref = ref_lib.Reference(emb.policy)
  for batch in helpers.draw_batches(seed, 5, size):
    assert np.asarray(emb.rows_of(batch)).tolist() == ref.step(ref_lib.as_uint64(batch))[0]
    assert emb.stats() == pytest.approx(ref.stats)
  assert emb.resident() == ref.resident()


def test_lookup_requests_is_one_step_of_the_policy_and_lookup_many_its_old_name():
  ids, single = np.array([[1, 2], [3, -1]]), np.array([1, 5])
  requests = [embedlib.Request(ids, None, "sum"), embedlib.Request(single)]
  emb = embedlib.DynamicEmbed(256, 4, rngs=nnx.Rngs(0))
  pooled, rows = emb.lookup_requests(requests)
  assert pooled.shape == (2, 4) and rows.shape == (2, 4) and int(emb.clock[...]) == 1
  old = embedlib.DynamicEmbed(256, 4, rngs=nnx.Rngs(0))
  with pytest.warns(DeprecationWarning, match=r"lookup_requests\(\[Request\("):
    got = old.lookup_many([(ids, None, "sum"), (single, None, None)])
  np.testing.assert_array_equal(got[0], pooled)
  np.testing.assert_array_equal(got[1], rows)
  assert old.resident() == emb.resident() and int(old.clock[...]) == 1


@pytest.mark.parametrize("kind", ["ShardedEmbed", "DynamicEmbed"])
def test_every_table_kind_checks_a_bag_the_same_way(kind):
  emb = getattr(embedlib, kind)(256, 4, name="t", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"t: bag\(\) takes ids \[batch, bag\].*shape \(3,\)"):
    emb.bag(np.array([1, 2, 3]))
  with pytest.raises(ValueError,
                     match=r"t: weights shape \(2, 3\) must equal the ids shape \(2, 2\)"):
    emb.bag(np.array([[1, 2], [3, 4]]), np.ones((2, 3), np.float32))
  with pytest.raises(ValueError, match=r"combiner='max'"):
    emb.lookup_requests([embedlib.Request(np.array([[1, 2]]), None, "max")])
