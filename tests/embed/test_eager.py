"""Eager calls on a mesh compile once, then reuse the executable.

Called outside jit, a lookup on a mesh used to dispatch op by op and compile
its ``shard_map`` and placements afresh every call (36 compiles, 0.5 to 1.2 s
per ``ShardedEmbed`` call; 15 s per call of the quickstart's collection).
Now the second identical call compiles nothing, and eager results equal the
jitted ones. The same for an eager ``SparseAwareOptimizer.update`` (5.5 s per
call before, on an 8-device 10,000 x 64 table). Counted with
``jax.monitoring`` (no timing).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import EmbeddingCollection, FeatureSpec, TableSpec, optim

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]


def _count(event, duration, **kwargs):
  del duration, kwargs
  if event == COMPILE_EVENT:
    _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


@contextlib.contextmanager
def counting():
  start, box = _compiles[0], {}
  yield box
  box["compiles"] = _compiles[0] - start


def mesh8():
  return jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])


@pytest.mark.parametrize("sharding", ["vocab", "hidden", "replicated"])
def test_sharded_embed_eager_calls_reuse_their_executable(sharding):
  emb = embedlib.ShardedEmbed(1001, 30, mesh=mesh8(), sharding=sharding, rngs=nnx.Rngs(0))
  ids = jnp.array([[0, 5, 1000], [7, -1, 3], [2, 2, 1001], [9, 8, 7]])
  query = jnp.ones((4, 30))
  first = emb(ids), emb.attend(query)
  ids2, query2 = ids + 1, query * 2   # new values, same shapes
  with counting() as again:
    second = emb(ids2), emb.attend(query2)
  assert again["compiles"] == 0
  jitted = nnx.jit(lambda m, i, q: (m(i), m.attend(q)))(emb, ids, query)
  for got, want in zip(first, jitted):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  want_rows = jnp.take(emb.logical_table(), jnp.where(ids + 1 < 1001, ids + 1, 0), axis=0)
  want_rows = jnp.where((ids + 1 < 1001)[..., None], want_rows, 0)
  np.testing.assert_array_equal(np.asarray(second[0]), np.asarray(want_rows))


def test_sharded_embed_eager_invalid_id_error_still_raises():
  emb = embedlib.ShardedEmbed(10, 4, mesh=mesh8(), invalid_ids="error", rngs=nnx.Rngs(0))
  with pytest.raises(IndexError, match="id 12"):
    emb(jnp.array([[1, 12]]))


def make_collection(**kwargs):
  return EmbeddingCollection(
      [TableSpec("item", 300, 16), TableSpec("country", 20, 4)],
      [FeatureSpec("clicks", "item", combiner="mean"),
       FeatureSpec("last", "item", max_ids_per_sample=1),
       FeatureSpec("country", "country", combiner=None)],
      mesh=mesh8(), replicate_below_bytes=0, rngs=nnx.Rngs(0), **kwargs)


FEATURES = {
    "clicks": jnp.array([[1, 2, -1], [3, 3, -1], [2, 7, 9], [0, -1, -1]]),
    "last": jnp.array([5, 6, 1, 1]),
    "country": jnp.array([[0, 19], [3, 3], [1, 2], [4, 5]]),
}


def test_collection_eager_calls_reuse_their_executable_and_keep_feature_order():
  coll = make_collection()
  first = coll(FEATURES)
  other = {k: jnp.where(v >= 0, (v + 1) % 20, v) for k, v in FEATURES.items()}
  with counting() as again:
    coll(other)
  assert again["compiles"] == 0
  assert list(first) == ["clicks", "last", "country"]
  jitted = nnx.jit(lambda c, f: c(f))(coll, FEATURES)
  for name in first:
    np.testing.assert_array_equal(np.asarray(first[name]), np.asarray(jitted[name]))


def test_collection_eager_dedup_overflow_still_raises():
  coll = make_collection(num_unique=2, on_overflow="error")
  with pytest.raises(ValueError, match="num_unique=2"):
    coll(FEATURES)


@pytest.mark.parametrize("sharding", ["vocab", "hidden"])
def test_sparse_optimizer_eager_update_reuses_its_executable(sharding):
  def build():
    emb = embedlib.ShardedEmbed(1001, 30, mesh=mesh8(), sharding=sharding, rngs=nnx.Rngs(0))
    return emb, optim.SparseAwareOptimizer(emb, None, optim.RowWiseAdagrad(0.1))

  ids = jnp.array([[0, 5, 1000], [7, -1, 5], [2, 2, 1001], [9, 8, 7]])
  grads = [optim.Grads(dense={}, rows={"": ((ids, jnp.full(ids.shape + (30,), k + 1.0)),)})
           for k in range(3)]
  eager, eager_opt = build()
  eager_opt.update(eager, grads[0])
  eager_opt.update(eager, grads[1])
  with counting() as third:
    eager_opt.update(eager, grads[2])
  assert third["compiles"] == 0
  jitted, jitted_opt = build()
  step = nnx.jit(lambda m, o, g: o.update(m, g))
  for g in grads:
    step(jitted, jitted_opt, g)
  np.testing.assert_array_equal(np.asarray(eager.embedding[...]), np.asarray(jitted.embedding[...]))
  np.testing.assert_array_equal(np.asarray(eager_opt.slots[0]["acc"][...]),
                                np.asarray(jitted_opt.slots[0]["acc"][...]))
  assert int(eager_opt.step[...]) == 3
  touched = np.zeros(1001, bool)
  touched[[0, 5, 1000, 7, 2, 9, 8]] = True
  start, _ = build()
  changed = np.any(np.asarray(eager.logical_table()) != np.asarray(start.logical_table()), axis=1)
  np.testing.assert_array_equal(changed, touched)
