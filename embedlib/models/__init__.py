"""Layer 7: recommender architectures built from arch blocks."""

from embedlib.models.blocks import MLP, CrossNetwork, dot_interaction
from embedlib.models.dlrm import DLRM
from embedlib.models.factory import build_model
from embedlib.models.multi_hash_embed import MultiHashEmbed

__all__ = ["DLRM", "MLP", "CrossNetwork", "MultiHashEmbed", "build_model", "dot_interaction"]
