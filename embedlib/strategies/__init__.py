"""Layer 3: the shard_map bodies, one small module per strategy.

Each strategy reads as input distribution -> local lookup -> output
distribution (``collectives.py``); ``sharded.py`` runs them over a mesh and
``dedup.py`` looks each shard's distinct ids up once. ``ShardedEmbed`` is
their only caller.
"""

from embedlib.strategies.request import Request
from embedlib.strategies.sharded import (
    attend,
    attend_vocab_split,
    lookup,
    lookup_bag,
    lookup_requests,
)

__all__ = [
    "Request",
    "attend",
    "attend_vocab_split",
    "lookup",
    "lookup_bag",
    "lookup_requests",
]
