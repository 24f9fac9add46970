"""Full ranking over the whole item vocabulary: HR@K, NDCG@K and MRR@K of one target per row.

No sampled negatives: a row's target is ranked against every item. Column 0
of the scores is padding and is never ranked; ``exclude`` removes more items
per row (the items a user has already seen, when a task masks them).

The rank of the target is the number of ranked items placed before it:
those with a higher score, and those with an equal score and a lower item
id. RecBole 1.2.1 (``trainer.py`` ``_full_sort_batch_eval``,
``evaluator/collector.py``) sets column 0 and the masked history to
``-inf`` and reads the target's position in ``torch.topk``; among equal
scores ``topk`` returns items in an unspecified order (on CPU it is not the
id order), so lower id first is one of the orders RecBole may produce, made
deterministic. Scores of a trained model almost never tie; the rule matters
for a constant model, where it ranks the target by its id instead of
crediting it with every tie. A target whose score is NaN ranks last.

The metrics of a row with 0-based rank ``r`` are RecBole's with a single
relevant item: ``hr@K = [r < K]``, ``ndcg@K = [r < K] / log2(r + 2)``,
``mrr@K = [r < K] / (r + 1)``, averaged over rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np


def target_ranks(scores, targets, exclude=None):
  """0-based rank of each row's target among the ranked items (jit-able).

  >>> scores = jnp.array([[9.0, 0.1, 0.5, 0.5, 0.2]])   # column 0 is padding
  >>> target_ranks(scores, jnp.array([3])).tolist()    # item 2 ties, lower id first
  [1]
  >>> target_ranks(scores, jnp.array([3]), exclude=jnp.array([[2, 0]])).tolist()
  [0]

  Args:
    scores: ``[B, V]`` scores over the whole vocabulary, column 0 (padding)
      included.
    targets: ``[B]`` int target item ids in ``1 .. V - 1``.
    exclude: optional ``[B, S]`` int item ids not to rank (0 = no item); a
      target listed there is still ranked.

  Returns:
    ``[B]`` int32 ranks, 0 for a target ranked first.
  """
  scores = jnp.asarray(scores)
  targets = jnp.asarray(targets).astype(jnp.int32)
  batch, vocab = scores.shape
  ids = jnp.arange(vocab, dtype=jnp.int32)[None, :]
  target_score = jnp.take_along_axis(scores, targets[:, None], axis=1)
  ahead = (scores > target_score) | ((scores == target_score) & (ids < targets[:, None]))
  ranked = ids != 0
  if exclude is not None:
    exclude = jnp.asarray(exclude).astype(jnp.int32)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], exclude.shape)
    excluded = jnp.zeros((batch, vocab), bool).at[rows, exclude].set(True, mode="drop")
    ranked = ranked & ~excluded
  rank = jnp.sum(ahead & ranked, axis=1, dtype=jnp.int32)
  last = jnp.sum(ranked & (ids != targets[:, None]), axis=1, dtype=jnp.int32)
  return jnp.where(jnp.isnan(target_score[:, 0]), last, rank)


def metrics_of_ranks(ranks, ks: Sequence[int] = (10, 20)) -> dict[str, np.ndarray]:
  """Per-row ``hr@K``, ``ndcg@K`` and ``mrr@K`` of 0-based ranks (numpy, float64).

  >>> {k: v.tolist() for k, v in metrics_of_ranks(np.array([0, 1, 12]), ks=(10,)).items()}
  {'hr@10': [1.0, 1.0, 0.0], 'ndcg@10': [1.0, 0.6309297535714575, 0.0], 'mrr@10': [1.0, 0.5, 0.0]}
  """
  ranks = np.asarray(ranks, np.float64)
  out = {}
  for k in ks:
    hit = ranks < k
    out[f"hr@{k}"] = hit.astype(np.float64)
    out[f"ndcg@{k}"] = np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0)
    out[f"mrr@{k}"] = np.where(hit, 1.0 / (ranks + 1.0), 0.0)
  return out


class FullRankingMetrics:
  """Averages HR@K, NDCG@K and MRR@K over eval batches; weights drop padded rows.

  >>> acc = FullRankingMetrics(ks=(1, 10))
  >>> acc.update(np.array([0, 3, 99]), np.array([1.0, 1.0, 0.0]))   # last row is padding
  >>> r = acc.result(); r["hr@1"], r["hr@10"], r["mrr@10"], r["count"]
  (0.5, 1.0, 0.625, 2.0)

  Args:
    ks: the cut-offs.
  """

  def __init__(self, ks: Sequence[int] = (10, 20)):
    if not ks or any(int(k) < 1 for k in ks):
      raise ValueError(f"ks={tuple(ks)}: give one or more cut-offs >= 1, e.g. ks=(10, 20).")
    self.ks = tuple(int(k) for k in ks)
    self.reset()

  def reset(self) -> None:
    self._sums = dict.fromkeys(metrics_of_ranks(np.zeros(0), self.ks), 0.0)
    self._count = 0.0

  def update(self, ranks, weights=None) -> None:
    """Adds a batch: ``ranks [B]`` from ``target_ranks``, ``weights [B]`` (1 real, 0 padding)."""
    ranks = np.asarray(ranks).reshape(-1)
    weights = np.ones(len(ranks)) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    if weights.shape != ranks.shape:
      raise ValueError(f"weights has shape {weights.shape} for {ranks.shape} ranks; give one "
                       "weight per row.")
    for name, values in metrics_of_ranks(ranks, self.ks).items():
      self._sums[name] += float(np.dot(values, weights))
    self._count += float(weights.sum())

  def result(self) -> dict[str, float]:
    """``{"hr@K", "ndcg@K", "mrr@K" for each K, "count"}``; NaN metrics before any row."""
    out = {name: (total / self._count if self._count else float("nan"))
           for name, total in self._sums.items()}
    out["count"] = self._count
    return out
