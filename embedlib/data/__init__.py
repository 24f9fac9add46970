"""Data sources for embedlib: the batch format, planted synthetic data, Criteo TSV, id hashing,
and MovieLens / RecBole files to a leave-one-out split (``embedlib.data.movielens``).

Every source yields the batch dict documented in ``embedlib.data.spec`` (this
process's rows only), keeps a resumable position (``get_state`` /
``set_state``), and takes ``process_index`` / ``process_count`` to read its
slice of each global batch. ``Prefetcher`` runs any of them in a background
thread, and ``to_global_batch`` puts a batch onto the mesh.

>>> from embedlib import data
>>> spec = data.DataSpec.from_sizes(4, [100, 100])
>>> batch = next(data.SyntheticSource(spec, batch_size=16))
>>> sorted(batch), batch["dense"].shape
(['dense', 'label', 'sparse'], (16, 4))
"""

from embedlib.data.criteo import (
    CRITEO_NUM_DENSE,
    CRITEO_NUM_SPARSE,
    BadLines,
    CriteoFormatError,
    CriteoReader,
    criteo_spec,
)
from embedlib.data.multi_hash import MultiHash, hash_collisions
from embedlib.data.planted_ranking import PlantedRankingSource
from embedlib.data.planted_retrieval import PlantedRetrievalSource
from embedlib.data.sequences import ACTIONS, BadBatchError, SequenceSpec, action_multi_hot
from embedlib.data.prefetch import Prefetcher, to_global_batch
from embedlib.data.spec import PAD_ID, DataSpec, SparseFeature
from embedlib.data.synthetic import SyntheticSource

__all__ = [
    "PAD_ID",
    "DataSpec",
    "SparseFeature",
    "SyntheticSource",
    "CriteoReader",
    "BadLines",
    "CriteoFormatError",
    "criteo_spec",
    "CriteoSynth",
    "MultiHash",
    "hash_collisions",
    "ACTIONS",
    "SequenceSpec",
    "PlantedRankingSource",
    "PlantedRetrievalSource",
    "action_multi_hot",
    "BadBatchError",
    "CRITEO_NUM_DENSE",
    "CRITEO_NUM_SPARSE",
    "Prefetcher",
    "to_global_batch",
]


def __getattr__(name):
  # criteo_synth is also a script (``python -m embedlib.data.criteo_synth``):
  # imported with the package, runpy would find it loaded before running it as
  # __main__ and warn on every run. It loads on first use instead.
  if name == "CriteoSynth":
    from embedlib.data.criteo_synth import CriteoSynth  # pylint: disable=g-import-not-at-top
    return CriteoSynth
  raise AttributeError(f"module 'embedlib.data' has no attribute {name!r}")
