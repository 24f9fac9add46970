"""NDCG@K and recall@K against their definitions."""

import itertools

import numpy as np

from embedlib.metrics import RankingMetrics, RetrievalMetrics, ndcg_at_k


def _ndcg_by_definition(gains, scores, k):
  order = sorted(range(len(gains)), key=lambda i: -scores[i])
  dcg = sum(gains[i] / np.log2(r + 2) for r, i in enumerate(order[:k]))
  ideal = sum(g / np.log2(r + 2) for r, g in enumerate(sorted(gains, reverse=True)[:k]))
  return dcg / ideal


def test_ndcg_matches_its_definition_and_ignores_masked_candidates():
  rng = np.random.default_rng(0)
  gains = rng.integers(0, 4, (50, 6)).astype(float)
  scores = rng.normal(size=(50, 6))
  mask = np.ones((50, 6), bool)
  mask[:, 4:] = False  # two padded candidates with large scores and gains: ignored
  padded_gains, padded_scores = gains.copy(), scores.copy()
  padded_gains[:, 4:], padded_scores[:, 4:] = 9.0, 9.0
  got, count = ndcg_at_k(padded_gains, padded_scores, mask, k=3)
  keep = gains[:, :4].sum(1) > 0
  want = np.mean([_ndcg_by_definition(g, s, 3) for g, s in zip(gains[keep, :4], scores[keep, :4])])
  assert count == keep.sum() and np.isclose(got, want)


def test_ranking_metrics_per_action_auc_and_weighted_ndcg():
  labels = np.array([[[1, 0], [0, 0], [0, 1]]], float)
  logits = np.array([[[3, -3], [0, 0], [-3, 3]]], float)
  weighted = RankingMetrics(("click", "like"), ndcg_weights=(1, 0), k=1)
  weighted.update(labels, logits, np.ones((1, 3), bool))
  r = weighted.result()
  assert r["auc/click"] == r["auc/like"] == 1.0 and r["ndcg@1"] == 1.0
  liked = RankingMetrics(("click", "like"), ndcg_weights=(0, 1), k=1)
  liked.update(labels, logits[..., ::-1], np.ones((1, 3), bool))  # scores swapped
  assert liked.result()["ndcg@1"] == 0.0


def test_recall_counts_each_request_once():
  m = RetrievalMetrics(ks=(1, 3))
  for perm in itertools.permutations(range(4)):  # item 0 at each rank 6 times
    m.update(np.array([perm]), np.array([0]))
  assert m.count == 24 and m.result() == {"recall@1": 0.25, "recall@3": 0.75}
