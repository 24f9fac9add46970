"""Layer 1: layout planning. Pure Python; reads meshes, allocates no arrays.

``choose`` decides a table's layout (``plan_embedding``), ``layout`` holds
the result (``EmbeddingPlan``), ``traffic`` and ``cost`` count the bytes it
moves, ``memory`` what a device holds for its training step (table, optimizer
slots, ids, temporaries), ``report`` prints it, ``checks`` validates the
arguments; ``settings`` holds what a table or a collection asks of the planner
(``Layout``, ``CollectionLayout``).
"""

from embedlib.plan.checks import check_shape
from embedlib.plan.choose import plan_embedding
from embedlib.plan.cost import bytes_moved_per_lookup, fit_id_skew, padded_shape
from embedlib.plan.layout import EmbeddingPlan
from embedlib.plan.mesh_axes import axes_size, mesh_shape, resolve_axes
from embedlib.plan.settings import CollectionLayout, Layout

__all__ = [
    "CollectionLayout",
    "EmbeddingPlan",
    "Layout",
    "axes_size",
    "bytes_moved_per_lookup",
    "check_shape",
    "fit_id_skew",
    "mesh_shape",
    "padded_shape",
    "plan_embedding",
    "resolve_axes",
]
