"""``plan_embedding``: which layout one table takes on a mesh, and why.

The auto rule weighs the layouts that fit by the bytes a lookup moves
(``cost.py``), within a device's memory when one is given; the result is an
``EmbeddingPlan`` (``layout.py``) whose ``reason`` says why.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from embedlib import options
from embedlib.plan import checks
from embedlib.plan import cost
from embedlib.plan import memory as memory_lib
from embedlib.plan import mesh_axes
from embedlib.plan import placement as placement_lib
from embedlib.plan.layout import EmbeddingPlan
from embedlib.plan.report import human_bytes

#: Tables at most this big (bytes) are replicated by ``sharding="auto"``.
REPLICATE_BELOW_BYTES = 1 << 20
#: Below this many columns per rank a hidden split is too narrow to pay off.
MIN_SHARD_WIDTH = 8
#: Hidden sharding is dropped when it pads this much more than vocab would.
MAX_EXTRA_PADDING = 0.10
#: Ids per device per lookup assumed when the caller doesn't say.
IDS_PER_DEVICE = 512


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
  others = ", ".join(f"{s} {human_bytes(costs[s])}" for s in candidates if s != best)
  reason = f"moves the fewest bytes per {per} ({human_bytes(costs[best])}; {others})"
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
        f"small table ({human_bytes(table)} <= "
        f"{human_bytes(replicate_below)}): a copy per device moves nothing"
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
    optimizer=memory_lib.DEFAULT_OPTIMIZER,
    id_skew: float = 0.0,
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
    device_memory_bytes: what one device may spend on the table's training
      step: its shard, the ``optimizer``'s slots, the ids and the lookup's
      and update's temporaries (``EmbeddingPlan.memory``). ``auto`` takes,
      among the layouts that fit, the one moving the fewest bytes, trying
      a grid (rows over ``table_axes``, columns over ``column_axes``) where
      no 1-D layout fits. None: no limit.
    devices_per_node: devices one node holds (fast links inside it, slower
      ones between nodes), counted in the table group's rank order; it must
      divide the group. A routed table spanning several nodes then takes
      the two-level route (inside each node, then across, each row once per
      node pair), the plan splits its bytes into intra- and inter-node and
      ``auto`` counts an inter-node byte as ``cost.INTER_NODE_WEIGHT``.
      None reads it from the mesh's devices (``mesh_axes.devices_per_node``:
      their process or slice indices), one node when they share one.
    node_capacity: distinct ids per destination rank that one node sends
      across nodes in the two-level route; None plans it for ids of
      ``id_skew`` (``cost.node_capacity``). A step needing more takes the
      flat route's buffers across nodes for that step (the same rows).
    optimizer: the sparse row-wise optimizer that trains the table, for
      its slots: a name of ``memory.OPTIMIZER_SLOTS``, a row-wise rule, or
      None (no slots).
    id_skew: how much the table's ids repeat, a Zipf exponent over its rows
      (``cost.distinct_ids``; 0, uniform ids, repeats least): the sparse
      update's route is sized for the distinct ids a device sends
      (``EmbeddingPlan.update_capacity``).

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
  num_embeddings, features = checks.check_shape(num_embeddings, features, name)
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
  columns = checks.grid_column_axes(shape, sharding, table, data, column_axes, name)
  grid_columns = columns if sharding == options.GRID else checks.auto_grid_columns(
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
    tokens = checks.check_size(tokens, "tokens", name)
    ids_per_device = -(-tokens // mesh_axes.axes_size(shape, data))
  elif ids_per_device is None:
    ids_per_device = IDS_PER_DEVICE
  ids_per_device = checks.check_size(ids_per_device, "ids_per_device", name)
  id_skew = checks.check_skew(id_skew, name)
  token_ranks = mesh_axes.axes_size(shape, [a for a in table if a in data])
  if route_capacity is not None:
    route_capacity = checks.check_capacity(route_capacity, group, name)
  if devices_per_node is None:
    devices_per_node = mesh_axes.devices_per_node(mesh, table)
  else:
    devices_per_node = checks.check_devices_per_node(devices_per_node, group, table, name)
  if node_capacity is not None:
    node_capacity = checks.check_capacity(node_capacity, group, name, what="node_capacity")
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
                else cost.node_capacity(capacity, devices_per_node, rows // group,
                                        skew=id_skew))
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
    checks.check_placement(placement, num_embeddings, group, sharding, name)
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
      def size(s):
        """Bytes one device holds for the table's step laid out as ``s``."""
        return plan_embedding(
            num_embeddings, features, mesh=mesh, sharding=s, table_axes=table_axes,
            data_axes=data_axes, tied=tied, param_dtype=param_dtype,
            ids_per_device=ids_per_device, route_capacity=route_capacity, name=name,
            column_axes=grid_columns if s == options.GRID else None,
            devices_per_node=devices_per_node, node_capacity=node_capacity,
            optimizer=optimizer, id_skew=id_skew).memory_per_device

      strategy, reason = _fit_memory(
          strategy, reason, device_memory_bytes, weighed, size, name=name, tied=tied,
          grid=bool(grid_columns), shape=(num_embeddings, features), group=group)
  else:
    strategy, reason = sharding, f"sharding={sharding!r} was requested"
  if strategy == options.REPLICATED:
    table, group, token_ranks = (), 1, 1
  if strategy != options.GRID:
    columns, column_group = (), 1
  padded = cost.padded_shape(num_embeddings, features, strategy, group, column_group)
  if placement is not None:
    padded = (group * placement.rows_per_rank, features)
  checks.check_rows(num_embeddings, padded[0], strategy, group, placement, name)
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
      optimizer=memory_lib.optimizer_key(optimizer),
      id_skew=id_skew,
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


def _fit_memory(strategy, reason, budget, moved, size, *, name, tied, grid, shape, group):
  """``(strategy, reason)``: ``auto``'s choice, or the cheapest layout that fits ``budget``.

  ``size(strategy)``: the bytes a device holds for the table's training step
  in that layout (table, slots, ids, temporaries).
  """
  if size(strategy) <= budget:
    return strategy, reason
  candidates, _ = sharded_candidates(*shape, group)
  if tied:  # the logits' layout: rows in blocks
    candidates = [s for s in candidates if s == options.VOCAB]
  candidates += [options.GRID] if grid else []
  fits = [s for s in candidates if size(s) <= budget]
  sizes = ", ".join(f"{s} {human_bytes(size(s))}" for s in [strategy] + candidates if s != strategy)
  if not fits:
    raise ValueError(
        f"{name}: no layout fits device_memory_bytes={budget} ({human_bytes(budget)}): "
        f"{strategy} needs {human_bytes(size(strategy))} a device (table, optimizer slots "
        f"and the step's temporaries), {sizes}; spread the table "
        f"over more devices (a larger mesh, or table_axes and column_axes covering more "
        f"axes), use a narrower param_dtype, or raise device_memory_bytes."
    )
  best, why = cheapest(fits, moved)
  return best, (f"{strategy} ({human_bytes(size(strategy))} a device) doesn't fit "
                f"device_memory_bytes ({human_bytes(budget)}); of the layouts that do, {why}")
