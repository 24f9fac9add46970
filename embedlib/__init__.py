"""embedlib: sharded embedding tables and recommender models for Flax NNX.

Layers, each importing only those above it in this list:
``plan`` (pure Python) -> ``kernels`` -> ``strategies`` -> ``embed``
(with ``logits`` and ``losses``, its vocab-parallel output) ->
``collection`` -> ``optim`` -> ``dynamic`` -> ``models``, ``data``, ``metrics``,
``checkpoint`` -> ``train``.

The names below are imported on first use (PEP 562), not by ``import
embedlib``: importing a subpackage runs this file first, and
``embedlib.serving`` (which loads an exported model with jax and numpy
alone) must not pull flax in with it.
"""

import importlib

from embedlib import cpu_pool

# Before jax can start its CPU backend: the pool XLA:CPU runs simulated
# devices on is sized once, when it starts (see embedlib.cpu_pool).
cpu_pool.configure()

#: Public name -> the module that defines it.
_EXPORTS = {
    "DynamicEmbed": "embedlib.dynamic",
    "DynamicSpec": "embedlib.collection",
    "EmbeddingCollection": "embedlib.collection",
    "EmbeddingPlan": "embedlib.plan",
    "FeatureSpec": "embedlib.collection",
    "LazyAdam": "embedlib.optim",
    "RowWiseAdagrad": "embedlib.optim",
    "QuantizedEmbed": "embedlib.quant",
    "ShardedEmbed": "embedlib.embed",
    "SparseAwareOptimizer": "embedlib.optim",
    "SparseSGD": "embedlib.optim",
    "TableSpec": "embedlib.collection",
    "VocabShardedLogits": "embedlib.logits",
    "export_disabled_checks": "embedlib.export_checks",
    "plan_embedding": "embedlib.plan",
    "quantize": "embedlib.quant",
    "vocab_parallel_cross_entropy": "embedlib.losses",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
  try:  # ``import embedlib; embedlib.models`` as when every name was imported eagerly
    return importlib.import_module(f"{__name__}.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"{__name__}.{name}":
      raise
    raise AttributeError(f"module 'embedlib' has no attribute {name!r}") from None


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
