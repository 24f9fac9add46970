"""auc and logloss against brute-force definitions; the streaming accumulator."""

import numpy as np
import pytest

from embedlib.metrics import StreamingMetrics, auc, logloss


def brute_force_auc(labels, scores, weights):
  """Weighted share of (positive, negative) pairs ordered right; ties count 1/2."""
  pos = np.flatnonzero(labels == 1)
  neg = np.flatnonzero(labels == 0)
  s_p, s_n = scores[pos][:, None], scores[neg][None, :]
  w = weights[pos][:, None] * weights[neg][None, :]
  wins = (s_p > s_n) + 0.5 * (s_p == s_n)
  return float((w * wins).sum() / w.sum())


@pytest.mark.parametrize("n", [2, 17, 300])
@pytest.mark.parametrize("distinct_scores", [3, 1000])  # 3: almost all tied
@pytest.mark.parametrize("weighted", [False, True])
def test_auc_equals_pairwise_count(n, distinct_scores, weighted):
  rng = np.random.default_rng(n * distinct_scores + weighted)
  labels = np.r_[0, 1, rng.integers(0, 2, n - 2)].astype(np.float32)
  scores = rng.integers(0, distinct_scores, n) / distinct_scores
  weights = rng.uniform(0.1, 3, n) if weighted else np.ones(n)
  expected = brute_force_auc(labels, scores, weights)
  got = auc(labels, scores, weights if weighted else None)
  assert got == pytest.approx(expected, abs=1e-12)


def test_auc_invariant_to_monotone_transform_and_reversed_by_negation():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 2, 500)
  logits = rng.normal(size=500) + labels
  a = auc(labels, logits)
  assert 0.6 < a < 0.9
  assert auc(labels, 1 / (1 + np.exp(-logits))) == pytest.approx(a)
  assert auc(labels, -logits) == pytest.approx(1 - a)


@pytest.mark.parametrize("labels", [[0, 0, 0], [1, 1]])
def test_auc_single_class_is_nan(labels):
  assert np.isnan(auc(labels, np.arange(len(labels))))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: auc([0, 1], [0.1]), "one score per label"),
        (lambda: auc([0, 0.5], [0.1, 0.2]), "0/1 labels"),
        (lambda: auc([0, 1], [0.1, np.nan]), "NaN"),
        (lambda: logloss([0, 1]), "exactly one"),
        (lambda: logloss([0, 1], [0.0, 1.0], probs=[0.1, 0.2]), "exactly one"),
        (lambda: logloss([0, 1], probs=[0.1, 1.5]), "probs must lie"),
    ],
)
def test_bad_inputs_raise_naming_the_problem(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_logloss_from_logits_matches_probs_and_definition():
  rng = np.random.default_rng(1)
  labels = rng.integers(0, 2, 200).astype(np.float64)
  logits = rng.normal(scale=3, size=200)
  weights = rng.uniform(0, 2, 200)
  p = 1 / (1 + np.exp(-logits))
  direct = -(weights * (labels * np.log(p) + (1 - labels) * np.log(1 - p))).sum() / weights.sum()
  assert logloss(labels, logits, weights=weights) == pytest.approx(direct, rel=1e-10)
  assert logloss(labels, probs=p, weights=weights) == pytest.approx(direct, rel=1e-6)


@pytest.mark.parametrize("logit, label, expected", [(800.0, 0, 800.0), (-800.0, 1, 800.0), (800.0, 1, 0.0)])
def test_logloss_from_extreme_logits_is_finite_and_exact(logit, label, expected):
  assert logloss([label], [logit]) == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["logits", "probs"])
def test_streaming_equals_one_shot(kind):
  rng = np.random.default_rng(2)
  labels = rng.integers(0, 2, 1000).astype(np.float32)
  logits = rng.normal(size=1000) + labels
  scores = logits if kind == "logits" else 1 / (1 + np.exp(-logits))
  m = StreamingMetrics()
  for chunk in np.array_split(np.arange(1000), 7):
    m.update(labels[chunk], **{kind: scores[chunk]})
  r = m.result()
  assert r["count"] == 1000 == m.count
  assert r["auc"] == pytest.approx(auc(labels, logits))
  assert r["logloss"] == pytest.approx(logloss(labels, logits), rel=1e-6)
  m.reset()
  assert m.result()["count"] == 0 and np.isnan(m.result()["auc"])


def test_streaming_accepts_jax_arrays_and_weights_and_rejects_mixed_kinds():
  import jax.numpy as jnp

  m = StreamingMetrics()
  m.update(jnp.array([1.0, 0.0, 1.0]), logits=jnp.array([1.0, 2.0, 3.0]), weights=jnp.array([1.0, 1.0, 0.0]))
  assert m.result()["auc"] == 0.0  # the only counted positive scores below the negative
  with pytest.raises(ValueError, match="fed logits before"):
    m.update([1.0], probs=[0.5])
