"""Eval metrics for click models: exact AUC and log-loss, and a streaming accumulator.

>>> from embedlib import metrics
>>> metrics.auc([0, 1], [0.2, 0.7])
1.0
"""

from embedlib.metrics.binary import auc, logloss
from embedlib.metrics.streaming import StreamingMetrics

__all__ = ["auc", "logloss", "StreamingMetrics"]
