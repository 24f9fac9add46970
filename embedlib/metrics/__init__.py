"""Eval metrics: exact AUC and log-loss for click models, per-action AUC and NDCG@K for
rankers, recall@K for retrievers, full-ranking HR / NDCG / MRR @K for next-item
models, each with an accumulator over eval batches.

>>> from embedlib import metrics
>>> metrics.auc([0, 1], [0.2, 0.7])
1.0
"""

from embedlib.metrics import full_ranking
from embedlib.metrics.binary import auc, logloss
from embedlib.metrics.full_ranking import FullRankingMetrics, target_ranks
from embedlib.metrics.ranking import RankingMetrics, RetrievalMetrics, ndcg_at_k
from embedlib.metrics.streaming import StreamingMetrics

__all__ = ["auc", "logloss", "ndcg_at_k", "RankingMetrics", "RetrievalMetrics",
           "StreamingMetrics", "full_ranking", "FullRankingMetrics", "target_ranks"]
