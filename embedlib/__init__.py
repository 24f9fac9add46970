"""embedlib: sharded embedding tables and recommender models for Flax NNX.

Layers, each importing only those listed above it (``tests/test_structure.py``
reads the imports and keeps this list true; modules on one line stand side
by side and import none of each other):

1. ``_compat``, ``_deprecated``, ``options``, ``axes``, ``invalid_ids``,
   ``lookahead``, ``tape``, ``table_paths``, ``cpu_pool``:
   names, rules and switches every layer shares
2. ``sharding``, ``plan``, ``host_memory``: mesh helpers; the planner, pure
   Python, which reads a mesh and decides each table's layout; glibc's hold
   on freed host memory
3. ``kernels``: local lookups of one shard; DLRM's dot interaction on CPU
4. ``strategies``: the ``shard_map`` bodies of each layout
5. ``table``, ``annotations``, ``logits``: a table drawn, loaded and
   unpadded; ``nnx.Embed`` annotations read; vocab-parallel logits
6. ``param``, ``losses``: the logical parameter; the vocab-parallel loss
7. ``embed``: ``ShardedEmbed``, the only caller of the strategies
8. ``dynamic``, ``quant``, ``optim``, ``export_checks``: raw-id tables,
   quantized tables, sparse optimizers, each built on ``embed``
9. ``collection``: many features over many tables, dynamic ones included
10. ``checkpoint``, ``data``, ``metrics``
11. ``tabular``: your own files (Parquet, CSV, RecBole) as typed columns
12. ``serving``
13. ``models``
14. ``training``, ``notebook``: the train loop; the notebooks' first cell

then ``train/``, ``configs/``, ``notebooks/`` and ``benchmarks/``, outside
the package.

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
    "CollectionLayout": "embedlib.plan",
    "DynamicEmbed": "embedlib.dynamic",
    "DynamicSpec": "embedlib.dynamic",
    "EmbeddingCollection": "embedlib.collection",
    "EmbeddingPlan": "embedlib.plan",
    "FeatureSpec": "embedlib.collection",
    "Layout": "embedlib.plan",
    "LazyAdam": "embedlib.optim",
    "QuantizedEmbed": "embedlib.quant",
    "Request": "embedlib.strategies",
    "RowWiseAdagrad": "embedlib.optim",
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
