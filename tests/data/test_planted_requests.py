"""Planted ranking and retrieval sources: determinism, process slices, the hidden model, bad batches."""

import numpy as np
import pytest

from embedlib.data import (PlantedRankingSource, PlantedRetrievalSource, SequenceSpec,
                           action_multi_hot)
from embedlib.metrics import auc

SPEC = SequenceSpec(num_items=3000, num_authors=60, history_len=10, num_candidates=6)
WORLD = dict(num_users=500, num_topics=12)
SOURCES = {"ranking": PlantedRankingSource, "retrieval": PlantedRetrievalSource}


def _equal(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("kind", SOURCES)
def test_deterministic_resumable_and_split_over_processes(kind):
  source = SOURCES[kind](SPEC, batch_size=32, **WORLD)
  first = [next(source) for _ in range(3)]
  SPEC.check_batch(first[0], kind=kind)
  again = SOURCES[kind](SPEC, batch_size=32, **WORLD)
  again.set_state({"position": 2})
  _equal(next(again), first[2])
  parts = [SOURCES[kind](SPEC, batch_size=32, process_index=i, process_count=4, **WORLD).batch(1)
           for i in range(4)]
  _equal({k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, first[1])
  other = SOURCES[kind](SPEC, batch_size=32, split="eval", **WORLD).batch(0)
  assert not np.array_equal(other["history_item"], first[0]["history_item"])


def test_ranking_lists_are_right_padded_and_labels_follow_the_history():
  source = PlantedRankingSource(SPEC, batch_size=2048, split="eval", num_batches=1, **WORLD)
  (batch, logits), = source.with_truth()
  for prefix in ("history", "candidate"):
    present = batch[f"{prefix}_item"] >= 0
    assert present[:, 0].all() and (np.diff(present.astype(int), axis=1) <= 0).all()
    assert ((batch[f"{prefix}_author"] >= 0) == present).all()
  mask = batch["candidate_item"] >= 0
  assert not batch["labels"][~mask].any() and not batch["history_actions"][batch["history_item"] < 0].any()
  labels = batch["labels"][mask]
  for a in range(SPEC.num_actions):  # the true logits rank the labels well above chance
    assert auc(labels[:, a], logits[mask][:, a]) > 0.65
  # A candidate by an author the history engaged with is liked more often.
  engaged = np.where(batch["history_actions"].any(-1), batch["history_author"], -2)
  repeat = (batch["candidate_author"][:, :, None] == engaged[:, None, :]).any(-1)[mask]
  assert labels[repeat, 1].mean() > 1.5 * labels[~repeat, 1].mean()


def test_retrieval_oracle_top_k_is_the_exact_best_ranking():
  source = PlantedRetrievalSource(SPEC, batch_size=64, num_batches=1, **WORLD)
  (batch, probs), = source.with_truth()
  world = source.world
  scores = np.log(probs[:, world.item_topic]) + world.item_log_pop[None, :]  # every item
  top = source.oracle_top_k(probs, 20)
  np.testing.assert_allclose(np.take_along_axis(scores, top, 1),
                             -np.sort(-scores, axis=1)[:, :20], rtol=1e-12)
  # The engaged item follows the history's topics.
  assert (probs[np.arange(64), world.item_topic[batch["item"]]] > 1.0 / WORLD["num_topics"]).mean() > 0.7


@pytest.mark.parametrize("field, value, match", [
    ("history_item", np.zeros((2, 11), np.int32),
     r'"history_item"\] holds 11 history entries per request, more than '
     r"config.data.history_len=10; keep the newest 10"),
    ("candidate_item", np.full((2, 6), 3000, np.int32),
     r'"candidate_item"\] has id 3000 outside \[0, 3000\) \(config.data.num_items=3000\)'),
    ("history_actions", np.zeros((2, 10, 6), np.float32),
     r'"history_actions"\] must be \[batch, history_len, num_actions\].*config.data.actions'),
    ("user", np.array([-3, 1]), r'"user"\] must hold integer ids >= 0'),
])
def test_bad_batches_name_the_field_and_the_fix(field, value, match):
  batch = SPEC.zeros(2)
  batch[field] = value
  with pytest.raises(ValueError, match=match):
    SPEC.check_batch(batch)


def test_action_lists_become_multi_hot_or_name_the_bad_index():
  hot = action_multi_hot(np.array([[[0, 4], [-1, -1]]]), 5)
  assert hot.tolist() == [[[1, 0, 0, 0, 1], [0, 0, 0, 0, 0]]]
  with pytest.raises(ValueError, match=r"action index 5 at \[0, 1, 0\] is past num_actions=5"):
    action_multi_hot(np.array([[[0, -1], [5, -1]]]), 5)
