"""``plan_embedding``: how one table is laid out on a mesh, and why.

Pure Python, no arrays: the plan is a frozen record of the strategy, the mesh
axes it uses, the logical and padded shapes, the per-device bytes and the
estimated bytes a lookup moves, plus a sentence saying why. ``ShardedEmbed``
and the collection build their parameters and shard_map specs from it.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

import numpy as np

from embedlib import options
from embedlib.plan import cost
from embedlib.plan import mesh_axes
from embedlib.plan import placement as placement_lib

#: Tables at most this big (bytes) are replicated by ``sharding="auto"``.
REPLICATE_BELOW_BYTES = 1 << 20
#: Below this many columns per rank a hidden split is too narrow to pay off.
MIN_SHARD_WIDTH = 8
#: Hidden sharding is dropped when it pads this much more than vocab would.
MAX_EXTRA_PADDING = 0.10
#: Ids per device per lookup assumed when the caller doesn't say.
IDS_PER_DEVICE = 512
#: Most rows a physical table (or stack) may have: ids are int32 (x64 off),
#: and a row count past int32's largest can't even be compared with them.
MAX_PHYSICAL_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan:
  """The layout of one embedding table on a mesh.

  ``table_axes`` are the mesh axes the table is split over (empty when it is
  replicated), ordered so that ``token_axes`` (table axes that are also data
  axes: each rank of the group holds other tokens) come first. A ``grid``
  table splits its rows over ``table_axes`` (its group) and its columns over
  ``column_axes`` at once, both ordered that way.

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

  @property
  def nodes(self) -> int:
    """Nodes the table group spans (``devices_per_node`` ranks each); 1 when unknown."""
    per = self.devices_per_node
    if not per or per >= self.group_size:
      return 1
    return self.group_size // per

  @property
  def node_route(self) -> bool:
    """Whether a routed lookup takes the two-level route (inside nodes, then across).

    A routed table over several nodes, when the route pays for
    ``ids_per_device`` ids (``node_pays``).
    """
    return (self.strategy == options.ROUTED and self.nodes > 1
            and self.node_pays(self.capacity_for(self.ids_per_device)))

  @property
  def node_update(self) -> bool:
    """Whether the sparse update's routed row gradients take the two-level route.

    Any row-split table over several nodes (a vocab table's update routes
    its row gradients as a routed table's does), when it pays
    (``node_pays``) at the update's capacity for ``ids_per_device`` ids.
    """
    return (self.strategy in options.ROW_SHARDED and self.nodes > 1
            and self.node_pays(self.update_capacity(self.ids_per_device)))

  def node_pays(self, capacity: int) -> bool:
    """Whether two levels move fewer weighed bytes than the flat route.

    ``cost.node_route_pays`` at ``capacity`` ids per destination.
    """
    return cost.node_route_pays(capacity, self.node_capacity_for(capacity), self.group_size,
                                self.devices_per_node)

  def node_capacity_for(self, capacity: int) -> int:
    """Distinct ids per destination rank one node sends across, for a route of ``capacity``.

    ``node_capacity`` when it was set, else ``cost.node_capacity`` (uniform
    ids, which repeat least); never more than the node's ranks send.
    """
    per = self.devices_per_node
    if self.node_capacity is not None:
      return min(self.node_capacity, per * capacity)
    return cost.node_capacity(capacity, per, self.padded_shape[0] // self.group_size)

  def node_bytes(self, ids: int | None = None) -> tuple[int, int]:
    """``(intra-node, inter-node)`` bytes a device receives per lookup of ``ids`` ids.

    The two-level route's own counts (``cost.node_route_bytes``); any other
    layout's ``bytes_moved_per_lookup`` split by the share of the group's
    peers in other nodes (``cost.inter_node_share``). ``(total, 0)`` for one
    node.
    """
    ids = self.ids_per_device if ids is None else ids
    if self.nodes == 1:
      return self.bytes_moved_per_lookup, 0
    if self.strategy == options.ROUTED:
      capacity = self.capacity_for(ids)
      entry = cost.ID_BYTES + self.padded_shape[1] * self.itemsize
      rest = mesh_axes.axes_size(dict(self.mesh_shape), self.rest_axes)
      gathered = (rest - 1) * cost.route_ids(ids, rest) * self.padded_shape[1] * self.itemsize
      if self.node_route:
        intra, inter = cost.node_route_bytes(
            capacity, self.node_capacity_for(capacity), self.group_size,
            self.devices_per_node, self.padded_shape[1], self.itemsize)
        return intra + gathered, inter
      group, per = self.group_size, self.devices_per_node
      flag = 2 * (group - 1) * cost.ID_BYTES // group
      flag_inter = 2 * (group - per) * cost.ID_BYTES // group
      return ((per - 1) * capacity * entry + flag - flag_inter + gathered,
              (group - per) * capacity * entry + flag_inter)
    inter = int(self.bytes_moved_per_lookup * cost.inter_node_share(self.group_size,
                                                                    self.devices_per_node))
    return self.bytes_moved_per_lookup - inter, inter

  @property
  def tokens(self) -> int:
    """Ids per lookup over the whole mesh (``ids_per_device`` per data shard)."""
    return self.ids_per_device * self.data_shards

  def capacity_for(self, ids: int) -> int:
    """Ids per destination of a routed lookup of ``ids`` ids per device.

    ``route_capacity`` when it was set, else ``cost.route_capacity`` of a
    uniform spread over the group (the stated slack); never more than the
    ids one rank routes (more slots would only move padding).
    """
    rest = mesh_axes.axes_size(dict(self.mesh_shape), self.rest_axes)
    if self.route_capacity is not None:
      return min(self.route_capacity, cost.route_ids(ids, rest))
    if self.placement is not None:  # members in the proportions planned
      total = sum(self.placement.ids) or 1
      return self.capacity_for_members({
          name: -(-ids * n // total) for (name, _), n in zip(self.placement.members,
                                                           self.placement.ids)
      })
    return cost.uniform_route_capacity(ids, self.group_size, rest)

  def capacity_for_members(self, ids_by_member) -> int:
    """``capacity_for`` a stack's step: ids per device of each member table."""
    if self.route_capacity is not None:
      return min(self.route_capacity, sum(ids_by_member.values()))
    return self.placement.capacity(ids_by_member)

  def sparse_update(self, ids: int, itemsize: int | None = None) -> tuple[str, int]:
    """How the sparse optimizers gather a step's row gradients, and the bytes it moves.

    For ``ids`` ids per device with gradients of ``itemsize`` bytes (default
    the table's): ``(way, bytes one device receives)``, the way one of

    - ``"gather"``: every data rank's ``(id, gradient)`` pairs all-gathered;
    - ``"route"``: a row-split table whose group holds different ids sends
      each distinct id's summed gradient to its owner;
    - ``"allreduce"``: a table every rank holds whole (replicated, hidden)
      all-reduces every row's summed gradient;
    - ``"none"``: one data shard, nothing to gather;

    whichever moves the fewest bytes among those the layout allows.
    ``embedlib.optim.apply_row_grads`` takes this way.

    >>> p = plan_embedding(100, 64, mesh={"batch": 8}, sharding="replicated")
    >>> p.sparse_update(512)
    ('allreduce', 45500)
    >>> plan_embedding(1_000_000, 64, mesh={"batch": 8}, sharding="routed").sparse_update(512)
    ('route', 171080)
    """
    itemsize = self.itemsize if itemsize is None else itemsize
    if not self.data_axes or self.data_shards < 2:
      return "none", 0
    ways = {"gather": cost.gather_pairs_bytes(ids, self.data_shards, self.features, itemsize)}
    if self.strategy in options.ROW_SHARDED:
      if self.token_axes and self.group_size > 1:
        ways["route"] = sum(self.update_node_bytes(ids, itemsize))
    elif self.strategy != options.GRID:  # a grid's ranks hold blocks of rows
      ways["allreduce"] = cost.allreduce_bytes(
          self.padded_shape[0], self.data_shards, self.features)
    way = min(ways, key=lambda w: (ways[w], w != "gather"))  # ties: the gather
    return way, ways[way]

  def update_node_bytes(self, ids: int, itemsize: int | None = None) -> tuple[int, int]:
    """``(intra-node, inter-node)`` bytes of the sparse update's route, ``ids`` ids per device.

    A row-split table whose group holds different ids; ``(total, 0)`` for
    one node. Over several nodes the routed lookup's two levels (one
    summed gradient per id and node pair crosses; the rounds' few scalars
    left out), the all-gather over the shard's replicas as a flat route's;
    the flat route (``node_update`` False) split as every group collective
    (``cost.inter_node_share``).
    """
    itemsize = self.itemsize if itemsize is None else itemsize
    capacity = self.update_capacity(ids)
    outer = mesh_axes.axes_size(dict(self.mesh_shape), self.outer_axes)
    total = cost.routed_pairs_bytes(capacity, self.group_size, outer, self.features, itemsize)
    if not self.node_update:
      inter = int(total * cost.inter_node_share(self.group_size, self.devices_per_node))
      return total - inter, inter
    entry = cost.ID_BYTES + self.features * itemsize
    per, nodes = self.devices_per_node, self.nodes
    replicas = (outer - 1) * self.group_size * capacity * entry
    inter = (nodes - 1) * self.node_capacity_for(capacity) * entry
    return (per - 1) * nodes * capacity * entry + replicas, inter

  def _update_summary(self) -> str:
    way, moved = self.sparse_update(self.ids_per_device)
    if way == "none":
      return "0 B per device (one data shard: the sparse optimizers gather no row gradients)"
    words = {"gather": "all-gather", "route": "route to their owners",
             "allreduce": "all-reduce"}
    text = f"{_human(moved)} per device, the sparse optimizers' {words[way]} of row gradients"
    if self.nodes > 1 and way == "route":
      text += f" ({_human(self.update_node_bytes(self.ids_per_device)[1])} across nodes)"
    return text

  def update_capacity(self, ids: int) -> int:
    """Ids per destination of the sparse update's route, for ``ids`` ids per device.

    The update sums each rank's duplicates before routing, so it sends
    distinct ids: their expected count for uniform ids (which repeat least),
    with the route's slack (``cost.dedup_capacity``, over a stack's tables
    together, from their lookups: a deduplicated stack's route carries the
    same distinct ids at the same capacity).
    A small table's ids then cost its few rows, not a slot per lookup; a
    step with more distinct ids for one owner takes more rounds, never
    dropping one. A ``route_capacity`` given is kept as it is.
    """
    if self.route_capacity is not None:
      return self.capacity_for(ids)
    if self.placement is None:
      return self.capacity_for(cost.dedup_capacity([(ids, self.num_embeddings)]))
    lookups = self.placement.lookups or self.placement.ids
    total = sum(lookups) or 1
    return self.capacity_for(cost.dedup_capacity([
        (-(-ids * n // total), rows) for (_, rows), n in zip(self.placement.members, lookups)]))

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
    mesh = ", ".join(f"{a}={n}" for a, n in self.mesh_shape) or "one device"
    lines = [
        f"EmbeddingPlan({self.name}: {self.num_embeddings} x {self.features})",
        f"  strategy        {self.strategy}",
        f"  mesh            {mesh}",
        f"  table_axes      {self.table_axes}  (token_axes {self.token_axes})",
        *([f"  column_axes     {self.column_axes}  (token_axes "
           f"{self.column_token_axes})"] if self.strategy == options.GRID else []),
        f"  data_axes       {self.data_axes}",
        f"  padded shape    {self.padded_shape[0]} x {self.padded_shape[1]}"
        f"  (+{100 * self.padding_overhead:.2f}% padding)",
        f"  shard shape     {self.shard_shape[0]} x {self.shard_shape[1]}",
        f"  bytes/device    {_human(self.bytes_per_device)}",
        f"  moved/lookup    {_human(self.bytes_moved_per_lookup)} per device"
        f" for {self.ids_per_device} ids per device",
        *([f"  across nodes    {_human(self.node_bytes()[1])} per lookup per device"
           f" ({_human(self.node_bytes()[0])} inside its node of {self.devices_per_node};"
           f" {self.nodes} nodes{', two-level route' if self.node_route else ''})"]
          if self.nodes > 1 else []),
        f"  moved/update    {self._update_summary()}",
        *([f"  route capacity  {self.capacity_for(self.ids_per_device)} ids per "
           f"destination"] if self.strategy == options.ROUTED else []),
        *([f"  node capacity   {self.node_capacity_for(self.capacity_for(self.ids_per_device))}"
           f" distinct ids per destination from each node"] if self.node_route else []),
        f"  reason          {self.reason}",
        *([f"  placement       {line}" for line in self.placement.describe()]
          if self.placement is not None else []),
    ]
    return "\n".join(wrapped for line in lines for wrapped in textwrap.wrap(
        line, _PRINT_WIDTH, subsequent_indent=" " * _VALUE_COLUMN, break_on_hyphens=False))


#: Columns a printed plan fits in, and where its field values start.
_PRINT_WIDTH, _VALUE_COLUMN = 100, 18


def _human(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return str(n)


def check_shape(num_embeddings, features, name: str = "table") -> tuple[int, int]:
  """``(num_embeddings, features)`` as ints, or a ValueError / TypeError naming the table.

  >>> check_shape(10, 4)
  (10, 4)
  """
  return (_check_size(num_embeddings, "num_embeddings", name),
          _check_size(features, "features", name))


def _check_size(value, what: str, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name}: {what} must be an int, got {value!r}.")
  if value < 1:
    raise ValueError(
        f"{name}: {what} must be >= 1, got {value}; an embedding table needs "
        f"at least one row and one column."
    )
  return int(value)


def sharded_candidates(num_embeddings, features, group):
  """The sharded layouts ``auto`` weighs for a table, and why hidden isn't one.

  Hidden needs at least ``MIN_SHARD_WIDTH`` columns a rank and not much
  more padding than rows would take; rows (routed, vocab) fit any table.

  >>> sharded_candidates(1000, 4, 8)
  (['routed', 'vocab'], 'width per rank (1 of 4) too narrow for a hidden split (< 8)')
  """
  candidates = [options.ROUTED, options.VOCAB]
  rows, cols = cost.padded_shape(num_embeddings, features, options.HIDDEN, group)
  vrows, _ = cost.padded_shape(num_embeddings, features, options.VOCAB, group)
  extra = (cols / features - 1) - (vrows / num_embeddings - 1)
  if cols // group < MIN_SHARD_WIDTH:
    return candidates, (f"width per rank ({cols // group} of {features}) too narrow for a "
                        f"hidden split (< {MIN_SHARD_WIDTH})")
  if extra > MAX_EXTRA_PADDING:
    return candidates, f"far less padding by rows ({100 * extra:.0f}% more for hidden)"
  return [options.HIDDEN] + candidates, None


def cheapest(candidates, moved, why_not=None, per="lookup"):
  """``(strategy, reason)``: the candidate moving the fewest bytes (ties: the earlier).

  ``moved(strategy)`` gives each candidate's bytes per device.
  """
  costs = {s: moved(s) for s in candidates}
  best = min(candidates, key=lambda s: costs[s])
  others = ", ".join(f"{s} {_human(costs[s])}" for s in candidates if s != best)
  reason = f"moves the fewest bytes per {per} ({_human(costs[best])}; {others})"
  return best, reason + (f"; {why_not}" if why_not else "")


def _choose(num_embeddings, features, group, itemsize, tied, replicate_below, moved):
  """The auto rule: returns (strategy, reason).

  ``moved(strategy)`` is the bytes a lookup of that layout moves per device.
  Replicate what is small, keep tied tables in vocab rows (their logits),
  and otherwise take the sharded layout that moves the fewest bytes among
  those that fit: hidden needs columns to split, routed and vocab rows.
  """
  table = num_embeddings * features * itemsize
  if group == 1:
    return options.REPLICATED, "the table group has one device"
  if table <= replicate_below:
    return options.REPLICATED, (
        f"small table ({_human(table)} <= "
        f"{_human(replicate_below)}): a copy per device moves nothing"
    )
  if tied:
    return options.VOCAB, (
        "tied output layer: vocab rows share their layout with the "
        "vocab-sharded logits of attend()"
    )
  if num_embeddings < group:
    return options.HIDDEN, (
        f"vocabulary ({num_embeddings}) smaller than the table group ({group})"
    )
  candidates, why_not = sharded_candidates(num_embeddings, features, group)
  return cheapest(candidates, moved, why_not)


def plan_embedding(
    num_embeddings: int,
    features: int,
    *,
    mesh=None,
    sharding: str = options.AUTO,
    table_axes=None,
    data_axes=None,
    tied: bool = False,
    param_dtype=np.float32,
    ids_per_device: int | None = None,
    route_capacity: int | None = None,
    replicate_below_bytes: int = REPLICATE_BELOW_BYTES,
    name: str = "table",
    placement: placement_lib.Placement | None = None,
    tokens: int | None = None,
    column_axes=None,
    device_memory_bytes: int | None = None,
    devices_per_node: int | None = None,
    node_capacity: int | None = None,
) -> EmbeddingPlan:
  """Decides how a ``(num_embeddings, features)`` table is laid out on a mesh.

  Args:
    num_embeddings: vocabulary size (rows of the logical table).
    features: embedding width (columns of the logical table).
    mesh: a ``Mesh``, an ``AbstractMesh``, a ``{axis: size}`` dict, or None
      for one device.
    sharding: ``"auto" | "replicated" | "vocab" | "hidden" | "routed" |
      "grid"``.
    table_axes: mesh axes the table is split over (default: the non-data
      axes, or all axes when every axis is a data axis); a grid's rows.
    data_axes: mesh axes the ids' leading dimension is split over (default:
      axes named like ``data``, ``batch``, ``replica``).
    tied: the table is also the output layer (``attend``): prefer vocab.
    param_dtype: dtype of the stored table, for the byte counts.
    ids_per_device: ids each device looks up per step (its share of the
      batch, bags flattened), for the traffic estimates and the auto choice
      (default ``IDS_PER_DEVICE``).
    route_capacity: ids per destination of a routed lookup; None derives it
      from the ids per rank with the slack of ``cost.route_capacity``.
    replicate_below_bytes: ``auto`` replicates tables up to this size.
    name: the table's name in messages.
    placement: for a stack of tables (``placement.place``): where each
      member's rows live; the table is then routed, its logical rows the
      members' one after the other.
    tokens: ids per lookup over the whole mesh, the older way to say
      ``ids_per_device`` (divided over the data shards); give one or neither.
    column_axes: a grid's column axes (``sharding="grid"``, or a grid
      ``auto`` may fall back to; default the data axes that are not table
      axes: FSDP's split of the width).
    device_memory_bytes: what one device may spend on the table: ``auto``
      takes, among the layouts that fit, the one moving the fewest bytes,
      trying a grid (rows over ``table_axes``, columns over ``column_axes``)
      where no 1-D layout fits. None: no limit.
    devices_per_node: devices one node holds (fast links inside it, slower
      ones between nodes), counted in the table group's rank order; it must
      divide the group. A routed table spanning several nodes then takes
      the two-level route (inside each node, then across, each row once per
      node pair), the plan splits its bytes into intra- and inter-node and
      ``auto`` counts an inter-node byte as ``cost.INTER_NODE_WEIGHT``.
      None reads it from the mesh's devices (``mesh_axes.devices_per_node``:
      their process or slice indices), one node when they share one.
    node_capacity: distinct ids per destination rank that one node sends
      across nodes in the two-level route; None plans it for uniform ids
      (``cost.node_capacity``). A step needing more takes the flat route's
      buffers across nodes for that step (the same rows).

  Returns:
    An ``EmbeddingPlan``.

  >>> p = plan_embedding(1_000_000, 100, mesh={"batch": 8})
  >>> p.strategy, p.padded_shape, p.token_axes
  ('hidden', (1000000, 104), ('batch',))
  >>> print(p.reason)
  moves the fewest bytes per lookup (196.00 KiB; routed 259.61 KiB, vocab 1.38 MiB)
  >>> plan_embedding(10_000_000, 128, mesh={"batch": 64}, ids_per_device=8192).strategy
  'routed'
  >>> g = plan_embedding(50257, 100, mesh={"fsdp": 2, "tensor": 4}, sharding="grid")
  >>> g.table_axes, g.column_axes, g.padded_shape, g.shard_shape
  (('tensor',), ('fsdp',), (50260, 100), (12565, 50))
  >>> a = plan_embedding(1 << 20, 256, mesh={"fsdp": 2, "tensor": 4},
  ...                    device_memory_bytes=200 << 20)   # 1-D: 256 MiB a device
  >>> a.strategy, a.bytes_per_device >> 20
  ('grid', 128)
  """
  num_embeddings, features = check_shape(num_embeddings, features, name)
  if sharding not in (options.AUTO,) + options.STRATEGIES:
    raise ValueError(
        f"{name}: sharding={sharding!r} is not a layout; use one of "
        f"{(options.AUTO,) + options.STRATEGIES}."
    )
  shape = mesh_axes.mesh_shape(mesh, name=name)
  table, data = mesh_axes.resolve_axes(shape, table_axes, data_axes, name=name)
  # Token axes first: the hidden all-to-all then reassembles columns in the
  # order the PartitionSpec lays them out (see strategies/collectives.py).
  table = tuple(a for a in table if a in data) + tuple(
      a for a in table if a not in data
  )
  columns = _column_axes(shape, sharding, table, data, column_axes, name)
  grid_columns = columns if sharding == options.GRID else _auto_columns(
      shape, sharding, table, data, column_axes, name)
  if sharding == options.AUTO:
    columns = grid_columns
  itemsize = np.dtype(param_dtype).itemsize
  group = mesh_axes.axes_size(shape, table)
  column_group = mesh_axes.axes_size(shape, columns)
  column_token_ranks = mesh_axes.axes_size(shape, [a for a in columns if a in data])
  if tokens is not None:
    if ids_per_device is not None:
      raise ValueError(
          f"{name}: pass ids_per_device (ids one device looks up) or tokens (ids over "
          f"the whole mesh), not both."
      )
    tokens = _check_size(tokens, "tokens", name)
    ids_per_device = -(-tokens // mesh_axes.axes_size(shape, data))
  elif ids_per_device is None:
    ids_per_device = IDS_PER_DEVICE
  ids_per_device = _check_size(ids_per_device, "ids_per_device", name)
  token_ranks = mesh_axes.axes_size(shape, [a for a in table if a in data])
  if route_capacity is not None:
    route_capacity = _check_capacity(route_capacity, group, name)
  if devices_per_node is None:
    devices_per_node = mesh_axes.devices_per_node(mesh, table)
  else:
    devices_per_node = _check_devices_per_node(devices_per_node, group, table, name)
  if node_capacity is not None:
    node_capacity = _check_capacity(node_capacity, group, name, what="node_capacity")
  nodes = group // devices_per_node if devices_per_node and devices_per_node < group else 1

  def moved(strategy):
    if strategy == options.ROUTED and nodes > 1:
      return sum(node_split(strategy))
    return flat_moved(strategy)

  def node_split(strategy):
    """``(intra, inter)`` bytes per device of a lookup across ``nodes`` nodes."""
    if strategy != options.ROUTED:
      total = flat_moved(strategy)
      inter = int(total * cost.inter_node_share(group, devices_per_node))
      return total - inter, inter
    rows, cols = cost.padded_shape(num_embeddings, features, strategy, group)
    rest = group // token_ranks
    capacity = (min(route_capacity, cost.route_ids(ids_per_device, rest))
                if route_capacity is not None
                else cost.uniform_route_capacity(ids_per_device, group, rest))
    per_node = (min(node_capacity, devices_per_node * capacity) if node_capacity is not None
                else cost.node_capacity(capacity, devices_per_node, rows // group))
    gathered = (rest - 1) * cost.route_ids(ids_per_device, rest) * cols * itemsize
    if not cost.node_route_pays(capacity, per_node, group, devices_per_node):
      total = flat_moved(strategy)
      entry = cost.ID_BYTES + cols * itemsize
      inter = ((group - devices_per_node) * capacity * entry
               + 2 * (group - devices_per_node) * cost.ID_BYTES // group)
      return total - inter, inter
    intra, inter = cost.node_route_bytes(capacity, per_node, group, devices_per_node, cols,
                                         itemsize)
    return intra + gathered, inter

  def weighed(strategy):
    if nodes == 1:
      return moved(strategy)
    intra, inter = node_split(strategy)
    return intra + cost.INTER_NODE_WEIGHT * inter

  def flat_moved(strategy):
    return cost.bytes_moved_per_lookup(
        cost.padded_shape(num_embeddings, features, strategy, group, column_group),
        strategy,
        column_token_ranks=column_token_ranks,
        column_rest_ranks=column_group // column_token_ranks,
        ids_per_device=ids_per_device,
        token_ranks=token_ranks,
        rest_ranks=group // token_ranks,
        itemsize=itemsize,
        capacity=None if route_capacity is None else min(
            route_capacity, cost.route_ids(ids_per_device, group // token_ranks)),
    )

  if placement is not None:
    _check_placement(placement, num_embeddings, group, sharding, name)
    strategy, reason = options.ROUTED, "a stack of tables: " + ", ".join(
        f"{m} ({k})" for (m, _), k in zip(placement.members, placement.kinds))
  elif sharding == options.AUTO:
    strategy, reason = _choose(
        num_embeddings, features, group, itemsize, tied, replicate_below_bytes, weighed
    )
    if nodes > 1:
      reason = reason.replace(
          "bytes per lookup (",
          f"bytes per lookup, a byte across nodes counted {cost.INTER_NODE_WEIGHT}x (")
    if device_memory_bytes is not None:
      strategy, reason = _fit_memory(
          strategy, reason, device_memory_bytes, weighed, name=name, tied=tied,
          grid=bool(grid_columns), shape=(num_embeddings, features), group=group,
          column_group=column_group, itemsize=itemsize)
  else:
    strategy, reason = sharding, f"sharding={sharding!r} was requested"
  if strategy == options.REPLICATED:
    table, group, token_ranks = (), 1, 1
  if strategy != options.GRID:
    columns, column_group = (), 1
  padded = cost.padded_shape(num_embeddings, features, strategy, group, column_group)
  if placement is not None:
    padded = (group * placement.rows_per_rank, features)
  _check_rows(num_embeddings, padded[0], strategy, group, placement, name)
  plan = EmbeddingPlan(
      num_embeddings=num_embeddings,
      features=features,
      strategy=strategy,
      table_axes=table,
      data_axes=data,
      mesh_shape=tuple(shape.items()),
      padded_shape=padded,
      itemsize=itemsize,
      ids_per_device=ids_per_device,
      bytes_per_device=cost.table_bytes_per_device(
          padded, strategy, group, itemsize, column_group
      ),
      bytes_moved_per_lookup=moved(strategy) if group * column_group > 1 else 0,
      reason=reason,
      name=name,
      route_capacity=route_capacity,
      placement=placement,
      column_axes=columns,
      devices_per_node=devices_per_node,
      node_capacity=node_capacity,
  )
  if placement is None:
    return plan
  plan = dataclasses.replace(plan, bytes_moved_per_lookup=cost.bytes_moved_per_lookup(
      padded, strategy, ids_per_device=ids_per_device, token_ranks=token_ranks,
      rest_ranks=group // token_ranks, itemsize=itemsize,
      capacity=plan.capacity_for(ids_per_device)))
  if plan.node_route:
    plan = dataclasses.replace(plan, bytes_moved_per_lookup=sum(plan.node_bytes()))
  return plan


def _auto_columns(shape, sharding, table, data, column_axes, name):
  """The column axes of the grid ``auto`` may fall back to, or ``()`` if there is none."""
  if sharding != options.AUTO:
    return ()
  columns = mesh_axes.as_axes(column_axes, "column_axes", name)
  if columns is None:
    columns = tuple(a for a in data if a not in table)
  if not columns or not table or set(columns) & set(table):
    return () if column_axes is None else _column_axes(
        shape, options.GRID, table, data, column_axes, name)
  return _column_axes(shape, options.GRID, table, data, columns, name)


def _fit_memory(strategy, reason, budget, moved, *, name, tied, grid, shape, group,
                column_group, itemsize):
  """``(strategy, reason)``: ``auto``'s choice, or the cheapest layout that fits ``budget``."""
  def size(s):
    g = 1 if s == options.REPLICATED else group
    c = column_group if s == options.GRID else 1
    return cost.table_bytes_per_device(cost.padded_shape(*shape, s, g, c), s, g, itemsize, c)

  if size(strategy) <= budget:
    return strategy, reason
  candidates, _ = sharded_candidates(*shape, group)
  if tied:  # the logits' layout: rows in blocks
    candidates = [s for s in candidates if s == options.VOCAB]
  candidates += [options.GRID] if grid else []
  fits = [s for s in candidates if size(s) <= budget]
  sizes = ", ".join(f"{s} {_human(size(s))}" for s in [strategy] + candidates if s != strategy)
  if not fits:
    raise ValueError(
        f"{name}: no layout fits device_memory_bytes={budget} ({_human(budget)}): "
        f"{strategy} needs {_human(size(strategy))} a device, {sizes}; spread the table "
        f"over more devices (a larger mesh, or table_axes and column_axes covering more "
        f"axes), use a narrower param_dtype, or raise device_memory_bytes."
    )
  best, why = cheapest(fits, moved)
  return best, (f"{strategy} ({_human(size(strategy))} a device) doesn't fit "
                f"device_memory_bytes ({_human(budget)}); of the layouts that do, {why}")


def _column_axes(shape, sharding, table, data, column_axes, name):
  """A grid's column axes, token axes first; ``()`` for the 1-D layouts."""
  if sharding != options.GRID:
    if sharding != options.AUTO and column_axes is not None and tuple(column_axes):
      raise ValueError(
          f"{name}: column_axes={column_axes!r} splits the columns as well as the "
          f"rows, which only sharding='grid' does (got sharding={sharding!r}); pass "
          f"sharding='grid', or drop column_axes."
      )
    return ()
  columns = mesh_axes.as_axes(column_axes, "column_axes", name)
  if columns is None:
    columns = tuple(a for a in data if a not in table)
  mesh_axes.check_axes(columns, "column_axes", shape, name)
  both = [a for a in columns if a in table]
  if both:
    raise ValueError(
        f"{name}: axis {both[0]!r} is in both table_axes={table} (rows) and "
        f"column_axes={columns} (columns); a mesh axis splits one dimension: "
        f"name it on one of them."
    )
  if not columns or not table:
    raise ValueError(
        f"{name}: sharding='grid' splits rows over table_axes and columns over "
        f"column_axes, got table_axes={table} and column_axes={columns} on the mesh "
        f"{dict(shape)}; pass both, e.g. table_axes=('tensor',), column_axes=('fsdp',)."
    )
  return tuple(a for a in columns if a in data) + tuple(a for a in columns if a not in data)


def _check_rows(num_embeddings, rows, strategy, group, placement, name):
  """Raises unless every (physical) row of the table is an int32 id."""
  if max(num_embeddings, rows) <= MAX_PHYSICAL_ROWS:
    return
  if placement is not None:
    members = ", ".join(f"{m} ({r:,} rows)" for m, r in placement.members)
    raise ValueError(
        f"{name}: this stack of tables [{members}] has {rows:,} physical rows "
        f"({group} devices x {placement.rows_per_rank:,}), past the {MAX_PHYSICAL_ROWS:,} "
        f"that int32 ids address; give its largest tables another layout "
        f"(sharding='vocab' or 'routed' splits a table's rows over the devices instead of "
        f"holding it whole on one), or split them into smaller tables.")
  padding = f" (padded to {rows:,} for {strategy} over {group})" if rows != num_embeddings else ""
  raise ValueError(
      f"{name}: {num_embeddings:,} rows{padding} is past the {MAX_PHYSICAL_ROWS:,} that "
      f"int32 ids address; split the table into tables of at most {MAX_PHYSICAL_ROWS:,} "
      f"rows, or hash its ids into fewer rows.")


def _check_placement(placement, num_embeddings, group, sharding, name):
  if sharding not in (options.AUTO, options.ROUTED):
    raise ValueError(
        f"{name}: a stack of tables (placement=) is routed; pass sharding='routed' "
        f"or 'auto', not {sharding!r}."
    )
  if placement.group != group or placement.num_embeddings != num_embeddings:
    raise ValueError(
        f"{name}: the placement is for {placement.num_embeddings} rows on "
        f"{placement.group} devices, the table has {num_embeddings} rows on a group "
        f"of {group}; plan the placement for this table and mesh."
    )


def _check_capacity(capacity, group: int, name: str, what: str = "route_capacity") -> int:
  """A route capacity must hold at least one id per destination."""
  if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
    raise TypeError(
        f"{name}: {what} must be an int (ids per destination rank), got "
        f"{capacity!r}."
    )
  if capacity < 1:
    raise ValueError(
        f"{name}: {what}={capacity} can't hold one id per destination "
        f"(the table group has {group} ranks); pass {what} >= 1, or "
        f"None to size it from the ids per device."
    )
  return int(capacity)


def _check_devices_per_node(per, group: int, table, name: str) -> int:
  """Devices per node must split the table group into whole nodes (or hold it whole)."""
  if isinstance(per, bool) or not isinstance(per, (int, np.integer)) or per < 1:
    raise ValueError(
        f"{name}: devices_per_node={per!r} must be a positive int, the devices one node "
        f"holds; pass e.g. devices_per_node=8, or None to read it from the devices."
    )
  per = int(per)
  if group % per and per % group:
    divisors = [d for d in range(1, group + 1) if group % d == 0]
    raise ValueError(
        f"{name}: devices_per_node={per} doesn't divide the table group of {group} "
        f"devices (table_axes {tuple(table)}), so the group's ranks can't be split into "
        f"whole nodes; pass one of {divisors} (the devices of one node that hold this "
        f"table), or None to read it from the devices."
    )
  return per
