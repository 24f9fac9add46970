"""Layer 7: recommender architectures built from arch blocks.

DLRM / DCN-v2 (``dlrm``), the transformer ranker with candidate isolation
(``ranker``, ``transformer``), two-tower retrieval (``two_tower``,
``retrieval``), multi-hash embeddings (``multi_hash_embed``), next-item
encoders (``sasrec``, ``hstu``, sharing ``next_item``); ``factory``
builds each from a config.
"""

from embedlib.models.blocks import MLP, CrossNetwork, dot_interaction
from embedlib.models.dlrm import DLRM
from embedlib.models.factory import build_model, hashers
from embedlib.models.hstu import HSTU
from embedlib.models.multi_hash_embed import MultiHashEmbed
from embedlib.models.ranker import RankerTrunk, TransformerRanker
from embedlib.models.sasrec import SASRec
from embedlib.models.retrieval import (StreamingFrequency, batch_log_q, in_batch_softmax_loss,
                                       sharded_top_k)
from embedlib.models.transformer import Transformer, isolation_mask
from embedlib.models.two_tower import TwoTower

__all__ = [
    "DLRM",
    "HSTU",
    "MLP",
    "CrossNetwork",
    "MultiHashEmbed",
    "RankerTrunk",
    "SASRec",
    "StreamingFrequency",
    "Transformer",
    "TransformerRanker",
    "TwoTower",
    "batch_log_q",
    "build_model",
    "dot_interaction",
    "hashers",
    "in_batch_softmax_loss",
    "isolation_mask",
    "sharded_top_k",
]
