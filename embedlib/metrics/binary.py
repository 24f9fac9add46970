"""Exact AUC and log-loss for binary click labels, in numpy on the host.

Eval sets of recommender runs fit in host memory, so these are exact (no
histogram buckets as in streaming TF metrics): ``auc`` equals scikit-learn's
``roc_auc_score``, ties included.
"""

from __future__ import annotations

import numpy as np


def _as_1d(name: str, values, dtype=np.float64) -> np.ndarray:
  array = np.asarray(values, dtype=dtype).reshape(-1)
  if not np.all(np.isfinite(array)):
    raise ValueError(f"{name} holds NaN or infinite values; check the model's outputs.")
  return array


def _inputs(labels, scores, weights, scores_name):
  labels = _as_1d("labels", labels)
  scores = _as_1d(scores_name, scores)
  if labels.shape != scores.shape:
    raise ValueError(
        f"labels has {labels.size} values but {scores_name} has {scores.size}; "
        "pass one score per label."
    )
  if weights is None:
    weights = np.ones_like(labels)
  else:
    weights = _as_1d("weights", weights)
    if weights.shape != labels.shape:
      raise ValueError(f"weights has {weights.size} values, labels has {labels.size}.")
    if np.any(weights < 0):
      raise ValueError("weights must be >= 0.")
  return labels, scores, weights


def auc(labels, scores, weights=None) -> float:
  """Area under the ROC curve; tied scores count one half (average rank).

  >>> auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
  0.75
  >>> auc([0, 1, 0, 1], [0.5, 0.5, 0.2, 0.9])  # one tied pair counts 1/2
  0.875

  It is the probability that a random positive outranks a random negative,
  each drawn in proportion to its weight, and equals sklearn's
  ``roc_auc_score(labels, scores, sample_weight=weights)``.

  Args:
    labels: ``[N]`` 0/1 (or bool) labels.
    scores: ``[N]`` scores of any monotone scale (logits or probabilities).
    weights: optional ``[N]`` non-negative example weights.

  Returns:
    The AUC in ``[0, 1]``, or NaN when either class has zero total weight
    (the AUC is undefined; an eval loop keeps running).
  """
  labels, scores, weights = _inputs(labels, scores, weights, "scores")
  if not np.all((labels == 0) | (labels == 1)):
    raise ValueError("auc needs 0/1 labels; threshold soft labels first.")
  pos_w = weights * labels
  neg_w = weights - pos_w
  total_pos, total_neg = pos_w.sum(), neg_w.sum()
  if total_pos <= 0 or total_neg <= 0:
    return float("nan")
  order = np.argsort(scores, kind="stable")
  sorted_scores = scores[order]
  # Group equal scores: each positive beats all negatives in lower groups and
  # ties with half of the negatives in its own group.
  starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
  group_pos = np.add.reduceat(pos_w[order], starts)
  group_neg = np.add.reduceat(neg_w[order], starts)
  neg_below = np.cumsum(group_neg) - group_neg
  wins = np.sum(group_pos * (neg_below + 0.5 * group_neg))
  return float(wins / (total_pos * total_neg))


def logloss(labels, logits=None, *, probs=None, weights=None, eps: float = 1e-7) -> float:
  """Mean binary cross-entropy (natural log), from logits or from probabilities.

  >>> round(logloss([1, 0], logits=[0.0, 0.0]), 4)  # log(2)
  0.6931
  >>> round(logloss([1, 0], probs=[0.9, 0.2]), 4)
  0.1643
  >>> logloss([1], logits=[1000.0])  # no overflow from logits
  0.0

  Args:
    labels: ``[N]`` labels in ``[0, 1]`` (soft labels allowed).
    logits: ``[N]`` logits; the stable form ``max(x, 0) - x*y + log1p(exp(-|x|))``
      is used, so no overflow for large ``|x|``.
    probs: ``[N]`` probabilities instead of logits, clipped to
      ``[eps, 1 - eps]``.
    weights: optional ``[N]`` non-negative example weights (weighted mean).
    eps: clipping for ``probs``.

  Returns:
    The weighted mean log-loss, or NaN when the total weight is 0.
  """
  if (logits is None) == (probs is None):
    raise ValueError("pass exactly one of logits= or probs=, e.g. logloss(labels, logits=z).")
  scores_name = "logits" if probs is None else "probs"
  labels, scores, weights = _inputs(
      labels, logits if probs is None else probs, weights, scores_name
  )
  if np.any((labels < 0) | (labels > 1)):
    raise ValueError("labels must lie in [0, 1].")
  if probs is not None:
    if np.any((scores < 0) | (scores > 1)):
      raise ValueError("probs must lie in [0, 1]; pass logits= for unbounded scores.")
    p = np.clip(scores, eps, 1 - eps)
    losses = -(labels * np.log(p) + (1 - labels) * np.log1p(-p))
  else:
    losses = np.maximum(scores, 0) - scores * labels + np.log1p(np.exp(-np.abs(scores)))
  total = weights.sum()
  if total <= 0:
    return float("nan")
  return float(np.dot(weights, losses) / total)
