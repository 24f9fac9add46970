"""The bytes a planned table's lookups and sparse updates move.

``cost.py``'s model applied to one plan's layout: route capacities, the
two-level route across nodes and its byte split, and the way the sparse
optimizers gather a step's row gradients. ``EmbeddingPlan`` (``layout.py``)
inherits these methods; they read only its fields and layout properties.
"""

from __future__ import annotations

from embedlib import options
from embedlib.plan import cost
from embedlib.plan import mesh_axes


class PlanTraffic:
  """Traffic methods of ``EmbeddingPlan`` (which holds the fields they read)."""

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

    ``node_capacity`` when it was set, else ``cost.node_capacity`` (for ids
    of the plan's ``id_skew``); never more than the node's ranks send.
    """
    per = self.devices_per_node
    if self.node_capacity is not None:
      return min(self.node_capacity, per * capacity)
    return cost.node_capacity(capacity, per, self.padded_shape[0] // self.group_size,
                              skew=self.id_skew)

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

    >>> from embedlib.plan import plan_embedding
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

  def update_capacity(self, ids: int) -> int:
    """Ids per destination of the sparse update's route, for ``ids`` ids per device.

    The update sums each rank's duplicates before routing, so it sends
    distinct ids: their expected count for ids of the plan's ``id_skew``
    (a stack's: each member's; 0, uniform ids, repeats least), with the
    route's slack (``cost.dedup_capacity``, over a stack's tables together,
    from their lookups: a deduplicated stack's route carries the same
    distinct ids at the same capacity).
    A small table's ids then cost its few rows, not a slot per lookup; a
    step with more distinct ids for one owner takes more rounds, never
    dropping one. A ``route_capacity`` given is kept as it is.
    """
    if self.route_capacity is not None:
      return self.capacity_for(ids)
    if self.placement is None:
      return self.capacity_for(
          cost.dedup_capacity([(ids, self.num_embeddings, self.id_skew)]))
    lookups = self.placement.lookups or self.placement.ids
    total = sum(lookups) or 1
    skews = self.placement.skews or (0.0,) * len(lookups)
    return self.capacity_for(cost.dedup_capacity([
        (-(-ids * n // total), rows, skew)
        for (_, rows), n, skew in zip(self.placement.members, lookups, skews)]))
