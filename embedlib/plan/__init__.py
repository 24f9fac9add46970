"""Layer 1: layout planning. Pure Python; reads meshes, allocates no arrays."""

from embedlib.plan.cost import bytes_moved_per_lookup, padded_shape
from embedlib.plan.embedding_plan import EmbeddingPlan, check_shape, plan_embedding
from embedlib.plan.mesh_axes import axes_size, mesh_shape, resolve_axes

__all__ = [
    "EmbeddingPlan",
    "axes_size",
    "bytes_moved_per_lookup",
    "check_shape",
    "mesh_shape",
    "padded_shape",
    "plan_embedding",
    "resolve_axes",
]
