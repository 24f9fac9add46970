"""Dynamic tables: raw ids, rows given on admission and taken back on eviction.

``DynamicEmbed`` (module), its settings (``spec``), its rules (``policy``),
the plain-Python oracle (``reference``), raw ids as uint32 words (``ids``),
the rows' default initializer (``initializers``), one shard's vectorised
step (``step``) and the map over a mesh (``mapping``).
"""

from embedlib.dynamic.ids import Words, words
from embedlib.dynamic.initializers import HashedUniform
from embedlib.dynamic.mapping import init_rows
from embedlib.dynamic.module import DynamicEmbed, DynamicMap, DynamicStats
from embedlib.dynamic.policy import Policy
from embedlib.dynamic.spec import DynamicSpec
from embedlib.dynamic.train import frozen_maps, reset_slots, step_stats

__all__ = ["DynamicEmbed", "DynamicMap", "DynamicSpec", "DynamicStats", "HashedUniform", "Policy",
           "Words", "frozen_maps", "init_rows", "reset_slots", "step_stats", "words"]
