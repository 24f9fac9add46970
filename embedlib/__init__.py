"""embedlib: sharded embedding tables and recommender models for Flax NNX.

Layers, each importing only those above it in this list:
``plan`` (pure Python) -> ``kernels`` -> ``strategies`` -> ``embed``
(with ``logits`` and ``losses``, its vocab-parallel output) ->
``collection`` -> ``optim`` -> ``models``, ``data``, ``metrics``,
``checkpoint`` -> ``train``.
"""

from embedlib.collection import EmbeddingCollection, FeatureSpec, TableSpec
from embedlib.embed import ShardedEmbed
from embedlib.export_checks import export_disabled_checks
from embedlib.logits import VocabShardedLogits
from embedlib.losses import vocab_parallel_cross_entropy
from embedlib.optim import LazyAdam, RowWiseAdagrad, SparseAwareOptimizer, SparseSGD
from embedlib.plan import EmbeddingPlan, plan_embedding
from embedlib.quant import QuantizedEmbed, quantize

__all__ = [
    "EmbeddingCollection",
    "EmbeddingPlan",
    "FeatureSpec",
    "LazyAdam",
    "QuantizedEmbed",
    "RowWiseAdagrad",
    "ShardedEmbed",
    "SparseAwareOptimizer",
    "SparseSGD",
    "TableSpec",
    "VocabShardedLogits",
    "export_disabled_checks",
    "plan_embedding",
    "quantize",
    "vocab_parallel_cross_entropy",
]
__version__ = "0.1.0"
