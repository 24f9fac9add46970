"""Layer 3: the shard_map bodies, one small module per strategy.

Every strategy is two phases: ``distribute`` (ids -> the state its layout
needs: gathered ids, buckets sent to their owners, a bag's coefficients)
and ``finish`` (table + that state -> rows), in ``replicated``, ``vocab``,
``hidden``, ``grid`` and ``routed`` (ids to the rank owning their rows,
rows back; ``nodes`` for two levels). ``runner`` owns token padding,
placement, ``shard_map`` and restore for all of them; ``sharded`` runs each
layout's phases through it, in line (``finish(distribute(...))`` in one
body) or a step ahead; ``dedup`` looks each shard's distinct ids up once;
``dispatch`` is the entry point and ``scores`` the attend. ``unique`` holds
the sort primitives, ``collectives`` the distribution steps.
``ShardedEmbed`` is their only caller.
"""

from embedlib.strategies.dispatch import distribute, finish, lookup_requests
from embedlib.strategies.request import Request
from embedlib.strategies.scores import attend, attend_vocab_split
from embedlib.strategies.sharded import lookup, lookup_bag

__all__ = [
    "Request",
    "attend",
    "attend_vocab_split",
    "distribute",
    "finish",
    "lookup",
    "lookup_bag",
    "lookup_requests",
]
