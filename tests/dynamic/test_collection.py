"""Dynamic tables in an ``EmbeddingCollection``: trained beside a fixed table, equal to the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embedlib import DynamicSpec, EmbeddingCollection, FeatureSpec, TableSpec, dynamic, optim
from embedlib.dynamic import reference as ref_lib
from tests.dynamic import helpers

LR = 0.5     # a power of two: the reference's updates are exact
BATCH, BAG, DIM = 4, 2, 4


def _collection(devices, sharding):
  spec = DynamicSpec(bucket_size=4, eviction="lru")
  return EmbeddingCollection(
      [TableSpec("users", 32, DIM, sharding=sharding, dynamic=spec),
       TableSpec("fixed", 10, DIM)],
      [FeatureSpec("clicks", "users", combiner="sum"),
       FeatureSpec("last", "users", combiner=None),
       FeatureSpec("country", "fixed")],
      mesh=helpers.mesh(devices), rngs=nnx.Rngs(0))


@nnx.jit
def _step(coll, opt, inputs, cots):
  def loss_fn(m):
    out = m(inputs)
    return sum(jnp.sum(out[k] * cots[k]) for k in cots)
  loss, grads = optim.value_and_grad(loss_fn)(coll)
  dynamic.reset_slots(opt, coll)
  opt.update(coll, grads)
  return loss


@pytest.mark.parametrize("devices,sharding", [(1, "auto"), (4, "auto"), (8, "routed")])
def test_collection_dynamic_table_equals_reference(devices, sharding):
  coll = _collection(devices, sharding)
  emb = coll.dynamic["users"]
  assert emb.rows.plan.strategy == ("vocab" if sharding == "auto" else sharding)
  with jax.set_mesh(coll.mesh):
    opt = optim.SparseAwareOptimizer(coll, None, optim.SparseSGD(learning_rate=LR))
  ref = ref_lib.Reference(emb.policy)
  table = helpers.ReferenceTable(32, DIM, emb.init_key[...])
  rng = np.random.default_rng(3)
  evicted = 0
  for _ in range(5):
    clicks = rng.choice(helpers.POOL, (BATCH, BAG))
    last = rng.choice(helpers.POOL, BATCH)
    cots = {k: rng.integers(-3, 4, (BATCH, DIM)).astype(np.float32)
            for k in ("clicks", "last", "country")}
    inputs = {"clicks": dynamic.words(clicks), "last": dynamic.words(last),
              "country": jnp.asarray(rng.integers(0, 10, BATCH), jnp.int32)}
    with jax.set_mesh(coll.mesh):
      _step(coll, opt, inputs, {k: jnp.asarray(v) for k, v in cots.items()})
    # The collection makes one policy step of both features' ids.
    rows, placed = ref.step(ref_lib.as_uint64(np.concatenate([clicks.reshape(-1), last])))
    table.place(placed)
    pooled = np.repeat(cots["clicks"], BAG, axis=0)      # a sum bag's members get its cotangent
    table.sgd(rows, np.concatenate([pooled, cots["last"]]), LR)
    evicted += ref.stats["evicted"]
  assert evicted > 0
  assert emb.resident() == ref.resident()
  np.testing.assert_array_equal(np.asarray(coll.logical_table("users")), table.table)
  stats = dynamic.step_stats(coll)
  assert stats["dynamic/dynamic/users/evicted"] == ref.stats["evicted"]
  assert stats["dynamic/dynamic/users/admitted"] == ref.stats["admitted"]


def test_all_dynamic_collection_and_eval_mode():
  coll = EmbeddingCollection(
      [TableSpec("t", 8, 2, dynamic=DynamicSpec(bucket_size=8, default="learned"))],
      [FeatureSpec("a", "t", combiner="mean")], rngs=nnx.Rngs(0))
  ids = np.array([[2**40, -1], [7, 7]], np.int64)
  out = coll({"a": ids})
  assert out["a"].shape == (2, 2) and set(coll.dynamic["t"].resident()) == {2**40, 7}
  coll.eval()
  before = coll.dynamic["t"].resident()
  coll({"a": [[5, 6], [7, -1]]})                        # host lists of ids too
  assert coll.dynamic["t"].resident() == before       # eval() only reads the map


@pytest.mark.parametrize("kw,words", [
    (dict(dynamic=DynamicSpec(admit_after=0)), "table 'u': admit_after=0"),
    (dict(dynamic=DynamicSpec(eviction="fifo")), "table 'u': eviction='fifo'"),
    (dict(dynamic=DynamicSpec(bucket_size=24)), "multiple of bucket_size=24"),
    (dict(sharding="table", dynamic=DynamicSpec()), "never stacked"),
])
def test_bad_dynamic_spec_names_the_table(kw, words):
  with pytest.raises(ValueError, match=words):
    TableSpec("u", 256, 4, **kw)


def test_ragged_ids_on_a_dynamic_table_are_refused():
  coll = EmbeddingCollection([TableSpec("t", 8, 2, dynamic=DynamicSpec(bucket_size=8))],
                             [FeatureSpec("a", "t")], rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="pad the bags"):
    coll({"a": (jnp.array([1, 2]), jnp.array([1, 1]))})
