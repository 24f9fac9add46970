"""Ranking and retrieval metrics on the host: per-action AUC, NDCG@K, recall@K.

A ranking request has up to ``C`` candidates (a mask marks the real ones)
and ``A`` actions per candidate; a retrieval request has one engaged item
and the ids a retriever returned for it, best first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from embedlib.metrics.binary import auc


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def ndcg_at_k(gains, scores, mask, k: int) -> tuple[float, int]:
  """Mean NDCG@k over requests, each ranking its own candidates by ``scores``.

  ``DCG@k = sum over the top k ranks r (1-based) of gain / log2(r + 1)``,
  divided by the DCG of the candidates sorted by gain. Requests without any
  gain have no NDCG and are left out; masked candidates are never ranked.
  Tied scores keep candidate order.

  >>> gains = np.array([[0.0, 3.0, 1.0]]); mask = np.ones((1, 3), bool)
  >>> ndcg_at_k(gains, np.array([[0.1, 0.9, 0.5]]), mask, k=3)  # the ideal order
  (1.0, 1)
  >>> round(ndcg_at_k(gains, np.array([[0.9, 0.1, 0.5]]), mask, k=2)[0], 4)
  0.1738

  Args:
    gains: ``[N, C]`` non-negative gains.
    scores: ``[N, C]`` the model's scores.
    mask: ``[N, C]`` which candidates are real.
    k: cut-off.

  Returns:
    ``(mean NDCG@k, number of requests with a gain)``.
  """
  gains = np.where(mask, np.asarray(gains, np.float64), 0.0)
  scores = np.where(mask, np.asarray(scores, np.float64), -np.inf)
  k = min(k, gains.shape[1])
  discount = 1.0 / np.log2(np.arange(2, k + 2))
  order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
  dcg = (np.take_along_axis(gains, order, axis=1) * discount).sum(axis=1)
  ideal = (-np.sort(-gains, axis=1)[:, :k] * discount).sum(axis=1)
  keep = ideal > 0
  if not keep.any():
    return float("nan"), 0
  return float(np.mean(dcg[keep] / ideal[keep])), int(keep.sum())


class RankingMetrics:
  """Per-action AUC and NDCG@k over the candidates of many requests.

  >>> m = RankingMetrics(("click", "like"), ndcg_weights=(1.0, 2.0), k=2)
  >>> labels = np.array([[[1, 0], [0, 1], [0, 0]]], np.float32)      # [N, C, A]
  >>> logits = np.array([[[2, -1], [-1, 3], [-2, -2]]], np.float32)
  >>> m.update(labels, logits, mask=np.array([[True, True, False]]))
  >>> r = m.result(); r["auc/click"], r["auc/like"], r["ndcg@2"]
  (1.0, 1.0, 1.0)

  Args:
    actions: action names, in label order (``[..., A]``).
    ndcg_weights: the gain of a candidate is ``sum_a w_a label_a``, and its
      score ``sum_a w_a sigmoid(logit_a)`` (its expected gain).
    k: the NDCG cut-off.
  """

  def __init__(self, actions: Sequence[str], *, ndcg_weights: Sequence[float], k: int):
    if len(ndcg_weights) != len(actions):
      raise ValueError(f"ndcg_weights has {len(ndcg_weights)} entries for {len(actions)} "
                       "actions; give one per action.")
    self.actions = tuple(actions)
    self.weights = np.asarray(ndcg_weights, np.float64)
    self.k = k
    self._labels, self._logits, self._masks = [], [], []

  def update(self, labels, logits, mask) -> None:
    """Adds requests: labels and logits ``[N, C, A]``, mask ``[N, C]``."""
    labels, logits = np.asarray(labels, np.float64), np.asarray(logits, np.float64)
    mask = np.asarray(mask, bool)
    if labels.shape != logits.shape or labels.shape[:2] != mask.shape:
      raise ValueError(f"labels {labels.shape}, logits {logits.shape} and mask {mask.shape} "
                       "must be [N, C, A], [N, C, A] and [N, C].")
    if labels.shape[-1] != len(self.actions):
      raise ValueError(f"labels have {labels.shape[-1]} actions, expected "
                       f"{len(self.actions)} ({self.actions}).")
    if not np.all(np.isfinite(logits)):
      raise ValueError("logits hold NaN or infinite values; check the model's outputs.")
    self._labels.append(labels)
    self._logits.append(logits)
    self._masks.append(mask)

  @property
  def count(self) -> int:
    """Requests collected."""
    return int(sum(m.shape[0] for m in self._masks))

  def result(self) -> dict:
    """``auc/<action>`` for each action, ``auc_mean``, ``ndcg@k``; NaN when undefined."""
    if not self._labels:
      return {**{f"auc/{a}": float("nan") for a in self.actions}, "auc_mean": float("nan"),
              f"ndcg@{self.k}": float("nan")}
    labels, logits = np.concatenate(self._labels), np.concatenate(self._logits)
    mask = np.concatenate(self._masks)
    out = {f"auc/{a}": auc(labels[..., i][mask], logits[..., i][mask])
           for i, a in enumerate(self.actions)}
    out["auc_mean"] = float(np.mean(list(out.values())))
    gains = labels @ self.weights
    scores = _sigmoid(logits) @ self.weights
    out[f"ndcg@{self.k}"] = ndcg_at_k(gains, scores, mask, self.k)[0]
    return out


class RetrievalMetrics:
  """Recall@K: the share of requests whose engaged item is among the top K returned.

  >>> m = RetrievalMetrics(ks=(1, 2))
  >>> m.update(top_ids=np.array([[5, 7], [1, 2], [3, 4]]), positives=np.array([7, 1, 9]))
  >>> m.result()
  {'recall@1': 0.3333333333333333, 'recall@2': 0.6666666666666666}

  Args:
    ks: the cut-offs; ``update`` needs at least ``max(ks)`` ids per request.
  """

  def __init__(self, ks: Sequence[int] = (1, 10, 100)):
    self.ks = tuple(sorted(int(k) for k in ks))
    self._hits = np.zeros(len(self.ks), np.int64)
    self._count = 0

  def update(self, top_ids, positives) -> None:
    """Adds requests: ``top_ids [N, >= max(ks)]`` best first, ``positives [N]``."""
    top_ids, positives = np.asarray(top_ids), np.asarray(positives)
    if top_ids.ndim != 2 or top_ids.shape[1] < self.ks[-1] or top_ids.shape[0] != positives.size:
      raise ValueError(f"top_ids must be [N, >= {self.ks[-1]}] for N={positives.size} "
                       f"positives, got {top_ids.shape}.")
    rank = np.where(top_ids == positives.reshape(-1, 1), np.arange(top_ids.shape[1]),
                    top_ids.shape[1]).min(axis=1)
    self._hits += (rank[:, None] < np.asarray(self.ks)).sum(axis=0)
    self._count += positives.size

  @property
  def count(self) -> int:
    return self._count

  def result(self) -> dict:
    """``{"recall@k": share}`` for each k; NaN before any update."""
    if not self._count:
      return {f"recall@{k}": float("nan") for k in self.ks}
    return {f"recall@{k}": float(h / self._count) for k, h in zip(self.ks, self._hits)}
