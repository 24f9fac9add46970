"""Collects predictions over eval batches; returns AUC, log-loss and count."""

from __future__ import annotations

import numpy as np

from embedlib.metrics.binary import auc, logloss


def _to_host(values) -> np.ndarray:
  """A flat float64 numpy copy; gathers a multi-process jax.Array first.

  A global ``jax.Array`` whose shards live on other processes cannot be read
  with ``np.asarray``; ``process_allgather`` is a collective, so every process
  must call ``update`` with its share of the same array.
  """
  if hasattr(values, "is_fully_addressable") and not values.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    values = multihost_utils.process_allgather(values, tiled=True)
  return np.asarray(values, np.float64).reshape(-1)


class StreamingMetrics:
  """Accumulates labels and scores over batches; exact AUC and log-loss at the end.

  >>> m = StreamingMetrics()
  >>> m.update([1, 0], logits=[2.0, -1.0])
  >>> m.update([1, 0], logits=[-0.5, 0.5])
  >>> r = m.result(); r["count"], r["auc"], round(r["logloss"], 3)
  (4, 0.75, 0.597)

  Predictions are kept in host memory (label, score and weight as float64:
  24 bytes per example, 2.4 GB for 100M); eval sets of recommender runs are
  far smaller. Feed
  either logits or probabilities, the same kind in every call.
  """

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    """Forgets everything collected so far."""
    self._labels, self._scores, self._weights = [], [], []
    self._kind = None

  def update(self, labels, logits=None, *, probs=None, weights=None) -> None:
    """Adds one batch.

    Args:
      labels: ``[B]`` 0/1 labels (numpy, list or jax.Array).
      logits: ``[B]`` logits, or
      probs: ``[B]`` probabilities instead.
      weights: optional ``[B]`` non-negative weights (0 masks padding rows).
    """
    if (logits is None) == (probs is None):
      raise ValueError("pass exactly one of logits= or probs=, e.g. update(labels, logits=z).")
    kind = "logits" if probs is None else "probs"
    if self._kind not in (None, kind):
      raise ValueError(
          f"this StreamingMetrics was fed {self._kind} before; pass {self._kind}= in every "
          "update, or reset() first."
      )
    self._kind = kind
    labels = _to_host(labels)
    scores = _to_host(logits if probs is None else probs)
    if labels.shape != scores.shape:
      raise ValueError(f"labels has {labels.size} values but {kind} has {scores.size}.")
    self._labels.append(labels)
    self._scores.append(scores)
    self._weights.append(np.ones_like(labels) if weights is None else _to_host(weights))

  @property
  def count(self) -> int:
    """Number of examples collected."""
    return int(sum(a.size for a in self._labels))

  def result(self) -> dict:
    """``{"auc": float, "logloss": float, "count": int}``; NaNs when empty."""
    if not self._labels:
      return {"auc": float("nan"), "logloss": float("nan"), "count": 0}
    labels = np.concatenate(self._labels)
    scores = np.concatenate(self._scores)
    weights = np.concatenate(self._weights)
    return {
        "auc": auc(labels, scores, weights),
        "logloss": logloss(labels, weights=weights, **{self._kind: scores}),
        "count": int(labels.size),
    }
