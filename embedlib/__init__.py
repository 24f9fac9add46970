"""embedlib: sharded embedding tables and recommender models for Flax NNX.

Layers, each importing only those above it in this list:
``plan`` (pure Python) -> ``kernels`` -> ``strategies`` -> ``embed`` ->
``collection`` -> ``optim`` -> ``models``, ``data``, ``metrics``,
``checkpoint`` -> ``train``.
"""

from embedlib.collection import EmbeddingCollection, FeatureSpec, TableSpec
from embedlib.embed import ShardedEmbed
from embedlib.optim import LazyAdam, RowWiseAdagrad, SparseAwareOptimizer, SparseSGD
from embedlib.plan import EmbeddingPlan, plan_embedding

__all__ = [
    "EmbeddingCollection",
    "EmbeddingPlan",
    "FeatureSpec",
    "LazyAdam",
    "RowWiseAdagrad",
    "ShardedEmbed",
    "SparseAwareOptimizer",
    "SparseSGD",
    "TableSpec",
    "plan_embedding",
]
__version__ = "0.1.0"
