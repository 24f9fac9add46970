"""Layer 3: the shard_map bodies, one small module per strategy.

Each strategy reads as input distribution -> local lookup -> output
distribution (``collectives.py``): ``replicated``, ``vocab``, ``hidden`` and
``routed`` (ids to the rank owning their rows, rows back). ``sharded.py``
runs them over a mesh, ``dedup.py`` looks each shard's distinct ids up once
and ``dispatch.py`` is the entry point. ``ShardedEmbed`` is their only
caller.
"""

from embedlib.strategies.dispatch import lookup_requests
from embedlib.strategies.request import Request
from embedlib.strategies.sharded import (
    attend,
    attend_vocab_split,
    lookup,
    lookup_bag,
)

__all__ = [
    "Request",
    "attend",
    "attend_vocab_split",
    "lookup",
    "lookup_bag",
    "lookup_requests",
]
