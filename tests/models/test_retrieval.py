"""Retrieval pieces against numpy references: the in-batch loss, sharded top-k, the towers."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from embedlib.data import SequenceSpec
from embedlib.models import (StreamingFrequency, batch_log_q, build_model, hashers,
                             in_batch_softmax_loss, sharded_top_k)


def _reference_loss(users, items, ids, temperature, log_q, hits):
  logits = users @ items.T / temperature - (0 if log_q is None else log_q[None, :])
  loss = 0.0
  for i in range(len(ids)):
    keep = [j for j in range(len(ids)) if j == i or not (hits and ids[j] == ids[i])]
    row = logits[i, keep]
    loss += np.log(np.exp(row - row.max()).sum()) + row.max() - logits[i, i]
  return loss / len(ids)


@pytest.mark.parametrize("hits", [True, False])
def test_in_batch_loss_matches_its_definition_with_log_q_and_hit_removal(hits):
  rng = np.random.default_rng(0)
  users = rng.normal(size=(16, 4)).astype(np.float32)
  items = rng.normal(size=(16, 4)).astype(np.float32)
  ids = np.array([3, 5, 3, 7, 9, 5, 5, 1, 2, 4, 6, 8, 10, 11, 12, 13], np.int32)
  log_q = np.asarray(batch_log_q(jnp.asarray(ids)))
  np.testing.assert_allclose(np.exp(log_q[:3]), [2 / 16, 3 / 16, 2 / 16], rtol=1e-6)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  got = jax.jit(lambda u, c: in_batch_softmax_loss(
      u, c, jnp.asarray(ids), temperature=jnp.float32(0.5), log_q=jnp.asarray(log_q),
      remove_accidental_hits=hits, mesh=mesh))(users, items)
  want = _reference_loss(users, items, ids, 0.5, log_q, hits)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_streaming_frequency_tracks_how_often_items_arrive():
  f = StreamingFrequency(1024, alpha=0.2, initial_gap=1.0)
  # Item 1 in every batch twice, item 2 in every batch once, item 3 every 4th batch.
  for step in range(60):
    ids = [1, 1, 2] + ([3] if step % 4 == 0 else [4 + step])
    log_q = np.asarray(f.update(jnp.array(ids)))
  freq = np.exp(log_q)
  np.testing.assert_allclose(freq[:3], [2.0, 2.0, 1.0], rtol=0.05)  # arrivals per step
  item3 = float(jnp.exp(f.update(jnp.array([3]))[0]))  # seen every 4th step
  assert abs(item3 - 0.25) < 0.02


@pytest.mark.parametrize("devices, n, valid", [(1, 96, 96), (8, 96, 90), (4, 200, 200)])
def test_sharded_top_k_is_the_exact_top_k(devices, n, valid):
  rng = np.random.default_rng(devices)
  queries = rng.normal(size=(5, 6)).astype(np.float32)
  corpus = rng.normal(size=(n, 6)).astype(np.float32)
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
  scores, rows = sharded_top_k(jnp.asarray(queries), jnp.asarray(corpus), 10, mesh=mesh,
                               axes=("data",), num_valid=valid)
  exact = queries @ corpus[:valid].T
  want = np.argsort(-exact, axis=1)[:, :10]
  np.testing.assert_array_equal(np.asarray(rows), want)
  np.testing.assert_allclose(np.asarray(scores), np.take_along_axis(exact, want, 1), rtol=1e-5)


@pytest.mark.parametrize("user_tower", ["pooled", "trunk"])
def test_both_user_towers_give_unit_vectors(user_tower):
  cfg = ml_collections.ConfigDict(dict(
      name="two_tower", user_tower=user_tower, features=8, tower_sizes=(16,), temperature=0.05,
      min_temperature=0.01, max_temperature=1.0, learn_temperature=True, author_features=4,
      action_features=4, width=16, num_layers=1, num_heads=2, mlp_ratio=2, causal=False,
      kernel="auto", replicate_below_bytes=0,
      item_hash=dict(num_buckets=256, num_hashes=2, features=8, combiner="concat", seed=1),
      user_hash=dict(num_buckets=64, num_hashes=2, features=16, combiner="sum", seed=0)))
  spec = SequenceSpec(num_items=100, num_authors=10, history_len=5)
  model = build_model(cfg, spec, rngs=nnx.Rngs(0))
  batch = spec.zeros(4, kind="retrieval")
  hash_ = hashers(cfg)  # the host side of the model's multi-hash tables
  batch["user"] = hash_["user"](batch["user"])
  batch["history_item"] = hash_["item"](batch["history_item"])
  # Jit'd: op by op, each primitive of the towers would compile a program.
  users = nnx.jit(lambda m, b: m.users(b))(model, batch)
  items = nnx.jit(lambda m, h, i: m.candidates(h, i))(
      model, jnp.asarray(model.items.hash(np.arange(4))), jnp.arange(4))
  np.testing.assert_allclose(np.linalg.norm(users, axis=1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(items, axis=1), 1.0, rtol=1e-5)
  assert float(model.temperature()) == pytest.approx(0.05)
