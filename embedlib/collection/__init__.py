"""Layer 5: many features over many sharded tables (``EmbeddingCollection``).

``specs`` describes tables and features, ``planner`` lays every table out
(one printed plan) by the bytes ``traffic`` counts a step moving, ``skew``
measures how much a table's ids repeat, ``inputs`` normalises the three id
forms, ``dedup`` looks each distinct id up once, and ``collection`` is the
``nnx.Module``.
"""

from embedlib.collection.collection import EmbeddingCollection
from embedlib.collection.planner import (
    CollectionPlan,
    TablePlan,
    estimate_bytes_moved,
    plan_collection,
)
from embedlib.collection.skew import fit_id_skews
from embedlib.collection.specs import DynamicSpec, FeatureSpec, Ragged, TableSpec

__all__ = [
    "CollectionPlan",
    "DynamicSpec",
    "EmbeddingCollection",
    "FeatureSpec",
    "Ragged",
    "TablePlan",
    "TableSpec",
    "estimate_bytes_moved",
    "fit_id_skews",
    "plan_collection",
]
