"""The transformer ranker: candidate isolation, on one device and on a sharded mesh.

A candidate's logits depend on the user, the history and that candidate
only. Tolerance 1e-5: other candidates change the shapes XLA compiles for,
and with them the order of some float sums.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from embedlib.data import PlantedRankingSource, SequenceSpec
from embedlib.models import build_model, hashers, isolation_mask

SPEC = SequenceSpec(num_items=500, num_authors=20, history_len=6, num_candidates=5)
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(**overrides):
  return ml_collections.ConfigDict(dict(
      name="ranker", width=16, num_layers=2, num_heads=2, mlp_ratio=2, causal=False,
      item_features=8, author_features=4, action_features=4, kernel="auto",
      replicate_below_bytes=0,
      user_hash=dict(num_buckets=128, num_hashes=2, features=8, combiner="concat", seed=0),
      **overrides))


def _batch(config, batch_size=8):
  batch = PlantedRankingSource(SPEC, batch_size=batch_size, num_users=50, num_topics=4).batch(0)
  batch["user"] = hashers(config)["user"](batch["user"])
  del batch["labels"]
  return batch


def _candidates(batch, order):
  """The batch with only the candidates ``order`` (indices, -1 for a padded slot), in that order."""
  out = dict(batch)
  for key in ("candidate_item", "candidate_author"):
    picked = batch[key][:, np.maximum(order, 0)]
    out[key] = np.where(np.asarray(order) >= 0, picked, -1).astype(np.int32)
  return out


_forward = nnx.jit(lambda model, batch: model(batch))


def test_isolation_mask_blocks_candidates_from_each_other_and_from_the_history():
  m = np.asarray(isolation_mask(jnp.array([[True, True, False]]), jnp.ones((1, 2), bool),
                                causal=True))[0, 0]
  # user, 2 history events, a padded event, 2 candidates
  assert m[:4, :4].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
  assert not m[:4, 4:].any()  # context never sees candidates
  assert m[4:, :3].all() and not m[4:, 3].any() and m[4:, 4:].tolist() == [[1, 0], [0, 1]]


@pytest.fixture(scope="module")
def ranker_and_batch():
  config = _config()
  return build_model(config, SPEC, rngs=nnx.Rngs(0)), _batch(config), config


def test_other_candidates_never_change_a_candidates_logits(ranker_and_batch):
  model, batch, _ = ranker_and_batch
  full = np.asarray(_forward(model, batch))
  assert full.shape == (8, 5, 5)
  real = batch["candidate_item"] >= 0
  perm = [3, 0, 4, 1, 2]
  np.testing.assert_allclose(np.asarray(_forward(model, _candidates(batch, perm))),
                             full[:, perm], **TOL)
  # Remove candidates 1 and 3 (pad their slots), then add two copies of candidate 0 and
  # two more from another request: candidates 0, 2 and 4 keep their logits.
  removed = np.asarray(_forward(model, _candidates(batch, [0, -1, 2, -1, 4])))
  np.testing.assert_allclose(removed[:, [0, 2, 4]], full[:, [0, 2, 4]], **TOL)
  grown = dict(batch)
  for key in ("candidate_item", "candidate_author"):
    extra = np.roll(batch[key][:, :2], 1, axis=0)
    grown[key] = np.concatenate([batch[key][:, [0, 2, 4]], batch[key][:, :1], extra], axis=1)
  wider = np.asarray(_forward(model, grown))  # 7 candidates: another compiled shape
  np.testing.assert_allclose(wider[:, :3], full[:, [0, 2, 4]], **TOL)
  np.testing.assert_allclose(wider[:, 3], full[:, 0], **TOL)
  # Not vacuous: the history and the candidate itself do change the logits.
  other_history = dict(batch, history_item=np.roll(batch["history_item"], 1, axis=0))
  assert np.abs(np.asarray(_forward(model, other_history)) - full)[real].max() > 1e-3
  assert np.abs(full[:, 0] - full[:, 1])[real[:, 1]].max() > 1e-3


def test_isolation_and_logits_hold_on_a_sharded_mesh(ranker_and_batch):
  model, batch, config = ranker_and_batch
  full = np.asarray(_forward(model, batch))
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  sharded = build_model(config, SPEC, mesh=mesh, rngs=nnx.Rngs(0))
  items = sharded.trunk.items
  assert items.plan.strategy != "replicated" and items.plan.group_size == 8
  np.testing.assert_array_equal(np.asarray(items.logical_table()),
                                np.asarray(model.trunk.items.logical_table()))
  on_mesh = np.asarray(_forward(sharded, batch))
  np.testing.assert_allclose(on_mesh, full, **TOL)
  perm = [4, 3, 2, 1, 0]
  np.testing.assert_allclose(np.asarray(_forward(sharded, _candidates(batch, perm))),
                             on_mesh[:, perm], **TOL)
  removed = np.asarray(_forward(sharded, _candidates(batch, [-1, 1, -1, 3, 4])))
  np.testing.assert_allclose(removed[:, [1, 3, 4]], on_mesh[:, [1, 3, 4]], **TOL)
  added = _candidates(batch, [0, 1, 2, 3, 4, 0, 2, 2])  # 8 candidates: repeats of others
  np.testing.assert_allclose(np.asarray(_forward(sharded, added))[:, :5], on_mesh, **TOL)


def test_sequence_models_plan_their_tables_for_the_batch_they_train_on():
  """Each table's plan counts the ids one device looks up: the history of its requests."""
  mesh8 = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  requests = 64 // 8
  ranker = nnx.eval_shape(lambda: build_model(_config(), SPEC, mesh=mesh8, batch_size=64,
                                              rngs=nnx.Rngs(0)))
  trunk = ranker.trunk
  assert trunk.items.plan.ids_per_device == requests * SPEC.history_len
  assert trunk.authors.plan.ids_per_device == requests * SPEC.history_len
  assert trunk.user.table.plan.ids_per_device == requests * 2  # two hashes a user
  tower_config = ml_collections.ConfigDict(dict(
      name="two_tower", user_tower="pooled", features=8, tower_sizes=(16,), temperature=0.05,
      min_temperature=0.01, max_temperature=1.0, learn_temperature=True, author_features=4,
      action_features=4, kernel="auto", replicate_below_bytes=0,
      item_hash=dict(num_buckets=128, num_hashes=3, features=8, combiner="concat", seed=1),
      user_hash=dict(num_buckets=64, num_hashes=2, features=8, combiner="concat", seed=0)))
  tower = nnx.eval_shape(lambda: build_model(tower_config, SPEC, mesh=mesh8, batch_size=64,
                                             rngs=nnx.Rngs(0)))
  assert tower.items.table.plan.ids_per_device == requests * SPEC.history_len * 3
  assert tower.authors.plan.ids_per_device == requests * SPEC.history_len
