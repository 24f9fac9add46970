"""metrics.full_ranking against a brute-force numpy ranking."""

import jax
import numpy as np
import pytest

from embedlib.metrics import full_ranking


def brute_force_rank(scores, target, exclude):
  """Sorts the ranked items by (score descending, id ascending) and finds the target."""
  if np.isnan(scores[target]):
    return sum(1 for j in range(1, len(scores)) if j != target and j not in exclude)
  items = [j for j in range(1, len(scores)) if j == target or j not in exclude]
  items.sort(key=lambda j: (-scores[j], j))
  return items.index(target)


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(0)
  batch, vocab = 64, 23
  # Few distinct values, so ties are everywhere; one row constant, one with a NaN target.
  scores = rng.integers(0, 4, (batch, vocab)).astype(np.float32)
  scores[0] = 1.0
  targets = rng.integers(1, vocab, batch).astype(np.int32)
  scores[1, targets[1]] = np.nan
  exclude = rng.integers(0, vocab, (batch, 5)).astype(np.int32)
  exclude[2, 0] = targets[2]  # an excluded target is still ranked
  want_plain = np.array([brute_force_rank(s, t, set()) for s, t in zip(scores, targets)])
  want_excl = np.array([brute_force_rank(s, t, set(e.tolist()) - {0})
                        for s, t, e in zip(scores, targets, exclude)])
  return scores, targets, exclude, want_plain, want_excl


def test_ranks_match_brute_force(case):
  scores, targets, exclude, want_plain, want_excl = case
  ranks = jax.jit(full_ranking.target_ranks)(scores, targets)
  assert ranks.dtype == np.int32
  np.testing.assert_array_equal(ranks, want_plain)
  np.testing.assert_array_equal(jax.jit(full_ranking.target_ranks)(scores, targets, exclude),
                                want_excl)
  assert want_plain[0] == targets[0] - 1  # constant scores: ranked by id, not credited the ties


def test_accumulated_metrics_match_brute_force(case):
  scores, targets, _, want, _ = case
  weights = np.ones(len(targets))
  weights[-7:] = 0.0  # padded rows
  acc = full_ranking.FullRankingMetrics(ks=(10, 20))
  ranks_of = jax.jit(full_ranking.target_ranks)
  for lo in range(0, len(targets), 16):  # several batches
    hi = lo + 16
    acc.update(ranks_of(scores[lo:hi], targets[lo:hi]), weights[lo:hi])
  got = acc.result()
  real = want[weights > 0]
  assert got["count"] == len(real)
  for k in (10, 20):
    np.testing.assert_allclose(got[f"hr@{k}"], np.mean(real < k), rtol=1e-12)
    np.testing.assert_allclose(got[f"ndcg@{k}"], np.mean(np.where(real < k, 1 / np.log2(real + 2), 0)),
                               rtol=1e-12)
    np.testing.assert_allclose(got[f"mrr@{k}"], np.mean(np.where(real < k, 1 / (real + 1), 0)),
                               rtol=1e-12)
  assert 0 < got["hr@10"] < got["hr@20"] < 1


def test_bad_arguments():
  with pytest.raises(ValueError, match="cut-offs >= 1"):
    full_ranking.FullRankingMetrics(ks=(0,))
  acc = full_ranking.FullRankingMetrics(ks=(10,))
  assert np.isnan(acc.result()["hr@10"])
  with pytest.raises(ValueError, match="one weight per row"):
    acc.update(np.zeros(3, np.int32), np.ones(2))
