"""``EmbeddingPlan``: the layout of one table on a mesh.

A frozen record of the strategy, the mesh axes it uses, the logical and
padded shapes, the per-device bytes and the estimated bytes a lookup moves,
plus a sentence saying why (``plan_embedding`` in ``choose.py`` decides it).
The properties here read the layout: axes, groups, shapes and specs; the
bytes its lookups and updates move are ``traffic.PlanTraffic``'s, its printed
form ``report.describe``'s. ``ShardedEmbed`` and the collection build their
parameters and shard_map specs from it.
"""

from __future__ import annotations

import dataclasses

from embedlib import options
from embedlib.plan import memory as memory_lib
from embedlib.plan import mesh_axes
from embedlib.plan import placement as placement_lib
from embedlib.plan import report
from embedlib.plan.traffic import PlanTraffic

#: ``EmbeddingPlan.memory``'s default optimizer: the plan's own.
_OWN = object()


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan(PlanTraffic):
  """The layout of one embedding table on a mesh.

  ``table_axes`` are the mesh axes the table is split over (empty when it is
  replicated), ordered so that ``token_axes`` (table axes that are also data
  axes: each rank of the group holds other tokens) come first. A ``grid``
  table splits its rows over ``table_axes`` (its group) and its columns over
  ``column_axes`` at once, both ordered that way.

  >>> from embedlib.plan import plan_embedding
  >>> p = plan_embedding(50257, 768, mesh={"data": 2, "model": 4}, tied=True)
  >>> p.strategy, p.table_axes, p.padded_shape
  ('vocab', ('model',), (50260, 768))
  """

  num_embeddings: int
  features: int
  strategy: str
  table_axes: tuple[str, ...]
  data_axes: tuple[str, ...]
  mesh_shape: tuple[tuple[str, int], ...]
  padded_shape: tuple[int, int]
  itemsize: int
  ids_per_device: int
  bytes_per_device: int
  bytes_moved_per_lookup: int
  reason: str
  name: str = "table"
  route_capacity: int | None = None
  placement: placement_lib.Placement | None = None
  column_axes: tuple[str, ...] = ()
  devices_per_node: int | None = None
  node_capacity: int | None = None
  optimizer: str | None = memory_lib.DEFAULT_OPTIMIZER
  id_skew: float = 0.0

  def memory(self, ids: int | None = None, *, num_unique: int | None = None,
             rows: int | None = None, optimizer=_OWN) -> memory_lib.TableMemory:
    """What one device holds for this table in a training step (``memory.table_memory``).

    The table's shard, the sparse ``optimizer``'s slots (default the plan's
    own ``optimizer``), the step's ``ids`` (default ``ids_per_device``) and
    the temporaries of the lookup (returning ``rows``, default ``ids``),
    dedup (``num_unique``) and update.

    >>> from embedlib.plan import plan_embedding
    >>> m = plan_embedding(1 << 20, 64, mesh={"batch": 8}, sharding="vocab").memory()
    >>> m.table, m.slots, m.total > m.table + m.slots
    (33554432, 524288, True)
    """
    if optimizer is _OWN:
      optimizer = self.optimizer
    return memory_lib.table_memory(self, ids, num_unique=num_unique, rows=rows,
                                   optimizer=optimizer)

  @property
  def memory_per_device(self) -> int:
    """Bytes one device holds for this table in a training step: ``memory().total``."""
    return self.memory().total

  @property
  def nodes(self) -> int:
    """Nodes the table group spans (``devices_per_node`` ranks each); 1 when unknown."""
    per = self.devices_per_node
    if not per or per >= self.group_size:
      return 1
    return self.group_size // per

  @property
  def tokens(self) -> int:
    """Ids per lookup over the whole mesh (``ids_per_device`` per data shard)."""
    return self.ids_per_device * self.data_shards

  @property
  def logical_shape(self) -> tuple[int, int]:
    return (self.num_embeddings, self.features)

  @property
  def token_axes(self) -> tuple[str, ...]:
    """Table axes over which ranks hold different tokens."""
    return tuple(a for a in self.table_axes if a in self.data_axes)

  @property
  def rest_axes(self) -> tuple[str, ...]:
    """Table axes over which ranks hold the same tokens."""
    return tuple(a for a in self.table_axes if a not in self.data_axes)

  @property
  def outer_axes(self) -> tuple[str, ...]:
    """Data axes outside the table group: ranks holding replicas of each shard."""
    return tuple(a for a in self.data_axes if a not in self.table_axes)

  @property
  def group_size(self) -> int:
    return mesh_axes.axes_size(dict(self.mesh_shape), self.table_axes)

  @property
  def column_token_axes(self) -> tuple[str, ...]:
    """A grid's column axes over which ranks hold different tokens."""
    return tuple(a for a in self.column_axes if a in self.data_axes)

  @property
  def column_rest_axes(self) -> tuple[str, ...]:
    """A grid's column axes over which ranks hold the same tokens."""
    return tuple(a for a in self.column_axes if a not in self.data_axes)

  @property
  def column_group_size(self) -> int:
    """Ranks a grid's columns are split over (1 for the 1-D layouts)."""
    return mesh_axes.axes_size(dict(self.mesh_shape), self.column_axes)

  @property
  def data_shards(self) -> int:
    return mesh_axes.axes_size(dict(self.mesh_shape), self.data_axes)

  @property
  def padding_overhead(self) -> float:
    """Padded elements as a fraction of the logical table."""
    padded = self.padded_shape[0] * self.padded_shape[1]
    return padded / (self.num_embeddings * self.features) - 1.0

  @property
  def table_spec(self) -> tuple:
    """Per-dimension mesh axes of the physical table (flax ``out_sharding``)."""
    split = self.table_axes or None
    if self.strategy == options.GRID:
      return (split, self.column_axes)
    if self.strategy in options.ROW_SHARDED:
      return (split, None)
    if self.strategy == options.HIDDEN:
      return (None, split)
    return (None, None)

  @property
  def logical_spec(self) -> tuple:
    """Per-dimension mesh axes of the unpadded table (``logical_table()``).

    ``table_spec`` when nothing is padded. Else (a ``jax.Array`` can't be
    split unevenly) the even split over the most devices of the table's own
    axes: the table's group trades its pieces with an all-to-all, never
    gathering it whole. Replicated when no group of table axes divides either
    size.

    >>> from embedlib.plan import plan_embedding
    >>> plan_embedding(99, 64, mesh={"model": 4}, sharding="vocab").logical_spec
    (None, ('model',))
    >>> plan_embedding(99, 99, mesh={"model": 4}, sharding="vocab").logical_spec
    (None, None)
    """
    if self.padded_shape == self.logical_shape:
      return self.table_spec
    group = {a: n for a, n in self.mesh_shape
             if a in self.table_axes + self.column_axes}
    return mesh_axes.even_split(
        self.logical_shape, group, also_divides=self.padded_shape, prefer=self.table_spec)

  @property
  def shard_shape(self) -> tuple[int, int]:
    rows, cols = self.padded_shape
    if self.strategy == options.GRID:
      return (rows // self.group_size, cols // self.column_group_size)
    if self.strategy in options.ROW_SHARDED:
      return (rows // self.group_size, cols)
    if self.strategy == options.HIDDEN:
      return (rows, cols // self.group_size)
    return (rows, cols)

  def __str__(self) -> str:
    """One field a line; a line past 100 columns wraps, indented under its field's value."""
    return report.describe(self)
