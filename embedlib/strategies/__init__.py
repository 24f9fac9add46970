"""Layer 3: the shard_map bodies, one small module per strategy.

Each strategy reads as input distribution -> local lookup -> output
distribution (``collectives.py``); ``sharded.py`` runs them over a mesh.
"""

from embedlib.strategies.sharded import attend, lookup, lookup_bag

__all__ = ["attend", "lookup", "lookup_bag"]
