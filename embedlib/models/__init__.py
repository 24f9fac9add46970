"""Layer 7: recommender architectures built from arch blocks."""

from embedlib.models.blocks import MLP, CrossNetwork, dot_interaction
from embedlib.models.dlrm import DLRM
from embedlib.models.factory import build_model

__all__ = ["DLRM", "MLP", "CrossNetwork", "build_model", "dot_interaction"]
