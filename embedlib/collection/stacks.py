"""Stacks: the tables of one width placed table-wise, table-row-wise or row-wise together.

A table asked for ``sharding="table"`` (whole on one device) or
``"table_row"`` (split over one host's devices), and, with
``table_batched=True``, every routed table, joins the stack of its width:
one routed ``ShardedEmbed`` whose rows ``plan.placement`` lays out
(``embedlib.plan.placement``). A stack's lookups of all its tables take one
route per step. With ``table_batched``, an auto table too small to split
(fewer than ``MIN_ROWS_PER_RANK`` rows a rank) is tried table-wise and kept
there if its stack then moves no more bytes. (With a static capacity per
destination it rarely does: a table's every lookup on one device raises
that device's bucket above the others'.)

With a ``device_memory_bytes``, a table goes table-wise only where the
step still fits it (``embedlib.collection.budget``). Pure Python.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from embedlib import options
from embedlib.collection.specs import FeatureSpec, TableSpec
from embedlib.plan import EmbeddingPlan, cost, mesh_axes, placement, plan_embedding

#: With ``table_batched``, auto tables with fewer rows a rank than this are
#: placed whole on one device: splitting them saves no memory worth having.
MIN_ROWS_PER_RANK = 256


def stack_name(features: int) -> str:
  """The name of the stack of tables ``features`` wide.

  >>> stack_name(16)
  'stack_16'
  """
  return f"stack_{features}"


@dataclasses.dataclass(frozen=True)
class StackPlan:
  """One stack: its routed plan (with the placement) and its traffic.

  Attributes:
    name: ``stack_<features>``.
    plan: the stack's ``EmbeddingPlan`` (``plan.placement`` places each
      member table).
    features: the features reading its tables.
    num_unique: dedup capacity per data shard, or None.
    bytes_moved: bytes per device per step, every member in one route.
    bytes_moved_dedup: the same with dedup at ``num_unique``, or None.
    bytes_moved_update: bytes per device per step of the sparse optimizers'
      gathering of row gradients (``EmbeddingPlan.sparse_update``).
  """

  name: str
  plan: EmbeddingPlan
  features: tuple[str, ...]
  num_unique: int | None
  bytes_moved: int
  bytes_moved_dedup: int | None
  bytes_moved_update: int = 0

  @property
  def members(self) -> tuple[str, ...]:
    return tuple(m for m, _ in self.plan.placement.members)


def stack_kind(spec: TableSpec, plan: EmbeddingPlan, *, table_batched: bool) -> str | None:
  """The placement kind of ``spec`` in its stack, or None for a table of its own."""
  if plan.group_size < 2:
    return None
  if spec.sharding in options.PLACEMENTS:
    return spec.sharding
  if not table_batched or plan.strategy != options.ROUTED:
    return None
  return placement.ROW


def small(spec: TableSpec, plan: EmbeddingPlan) -> bool:
  """Whether an auto table is too small to be worth splitting by rows."""
  return (spec.sharding == options.AUTO
          and spec.num_embeddings < MIN_ROWS_PER_RANK * plan.group_size)


def traffic(plan: EmbeddingPlan, ids_by_member: Mapping[str, int], num_unique=None) -> int:
  """Bytes per device of one route of a stack (ids per device by member)."""
  if plan.nodes > 1:  # the two-level route's bytes, or the flat route's split by node
    return sum(plan.node_bytes(sum(ids_by_member.values()) if num_unique is None
                               else num_unique))
  token = mesh_axes.axes_size(dict(plan.mesh_shape), plan.token_axes)
  if num_unique is None:
    ids = sum(ids_by_member.values())
    capacity = plan.capacity_for_members(dict(ids_by_member))
  else:
    ids, capacity = num_unique, plan.capacity_for(num_unique)
  return cost.bytes_moved_per_lookup(
      plan.padded_shape, options.ROUTED, ids_per_device=ids, token_ranks=token,
      rest_ranks=plan.group_size // token, itemsize=plan.itemsize, capacity=capacity)


def plan_stacks(tables: Sequence[TableSpec], features: Sequence[FeatureSpec], kinds, ids, *,
                mesh, table_axes, data_axes, param_dtype, devices_per_host,
                num_unique: Mapping[str, int], route_capacity: Mapping[str, int],
                devices_per_node: int | None = None,
                node_capacity: Mapping[str, int] | None = None):
  """One ``StackPlan`` per width among the tables with a placement kind.

  Args:
    tables: the ``TableSpec`` s.
    features: the ``FeatureSpec`` s.
    kinds: table name -> placement kind (tables without one stay apart).
    ids: table name -> ids per device per step.
    mesh, table_axes, data_axes, param_dtype: as for ``plan_embedding``.
    devices_per_host: devices of one host, for ``"table_row"``.
    num_unique, route_capacity: by stack name.
    devices_per_node: devices one node holds (see ``plan_embedding``).
    node_capacity: by stack name (see ``plan_embedding``).

  Returns:
    The ``StackPlan`` s, one per width, in the order the widths first appear.
  """
  widths = []
  for t in tables:
    if t.name in kinds and t.features not in widths:
      widths.append(t.features)
  out = []
  for width in widths:
    name = stack_name(width)
    members = [t for t in tables if t.name in kinds and t.features == width]
    shape = mesh_axes.mesh_shape(mesh)
    axes, _ = mesh_axes.resolve_axes(shape, table_axes, data_axes, name=name)

    def planned(lookups, members=members, name=name, width=width, axes=axes, shape=shape,
                raw=None):
      """The stack placed balancing ``lookups`` (rows looked up per device by member).

      ``raw``: where ``lookups`` counts distinct ids, the lookups per member.
      """
      placed = placement.place(
          [placement.Member(t.name, t.num_embeddings, max(lookups[t.name], 1), kinds[t.name],
                            device=t.device, host=t.host,
                            lookups=None if raw is None else max(raw[t.name], 1),
                            skew=t.id_skew)
           for t in members],
          group=mesh_axes.axes_size(shape, axes), devices_per_host=devices_per_host,
          name=name)
      return plan_embedding(
          placed.num_embeddings, width, mesh=mesh, sharding=options.ROUTED,
          table_axes=table_axes, data_axes=data_axes, param_dtype=param_dtype,
          ids_per_device=max(1, sum(ids[t.name] for t in members)),
          route_capacity=route_capacity.get(name), name=name, placement=placed,
          devices_per_node=devices_per_node, node_capacity=(node_capacity or {}).get(name))

    by_member = {t.name: max(ids[t.name], 1) for t in members}
    plan = planned(by_member)
    cap = num_unique.get(name)
    if cap == options.AUTO:
      plan, cap = _dedup_if_it_pays(plan, planned, members, by_member)
    out.append(StackPlan(
        name=name, plan=plan,
        features=tuple(f.name for f in features if f.table in by_member),
        num_unique=cap,
        bytes_moved=traffic(plan, by_member),
        bytes_moved_dedup=None if cap is None else traffic(plan, by_member, cap),
        bytes_moved_update=plan.sparse_update(sum(by_member.values()))[1],
    ))
  return out


def _dedup_if_it_pays(plan, planned, members, by_member):
  """``num_unique="auto"`` for a stack: ``(plan, capacity)``, or ``(plan, None)``.

  Deduplicated, a stack routes each member's distinct ids (for ids of its
  ``id_skew``: a small table sends its few rows, not one per lookup), so it is
  placed balancing those, and the route's capacity follows their
  proportions (``EmbeddingPlan.capacity_for``). Kept when that saves more
  bytes than dedup's own work on the ids costs (``cost.dedup_pays``) against
  routing every id with the plain placement.
  """
  distinct = {t.name: math.ceil(cost.distinct_ids(by_member[t.name], t.num_embeddings,
                                                  t.id_skew)[0])
              for t in members}
  capacity = cost.dedup_capacity([(by_member[t.name], t.num_embeddings, t.id_skew)
                                  for t in members])
  deduped = planned(distinct, raw=by_member)
  if cost.dedup_pays(traffic(plan, by_member), traffic(deduped, by_member, capacity),
                     sum(by_member.values())):
    return deduped, capacity
  return plan, None


def placed_on(stack: StackPlan, table: str) -> str:
  """Where a member lives, in words: ``device 3``, ``devices 0-3``, ``all devices``."""
  devices = stack.plan.placement.devices(table)
  if len(devices) == stack.plan.group_size and len(devices) > 1:
    return "all devices"
  if len(devices) == 1:
    return f"device {devices[0]}"
  return f"devices {devices[0]}-{devices[-1]}"


def table_wise_where_it_pays(small, kinds, plan_stacks, fits):
  """``(kinds, stacks)``: ``small`` auto tables table-wise where their stack then moves no more.

  All of them at once (they may balance each other), then one at a time.
  Table-wise, a device holds whole tables: a trial is kept only where
  ``fits(tried_stacks, stacks)`` (the memory budget).

  Args:
    small: the ``TableSpec`` s of auto tables too small to split (``small``).
    kinds: table name -> placement kind.
    plan_stacks: ``kinds -> [StackPlan]``.
    fits: ``(tried, current) -> bool``, two lists of ``StackPlan`` s.
  """
  stacks = plan_stacks(kinds)
  moved = lambda stacks: sum(s.bytes_moved + s.bytes_moved_update for s in stacks)
  names = [t.name for t in small if kinds.get(t.name) == placement.ROW]
  for some in [names] + [[n] for n in names]:
    tried = dict(kinds, **{n: options.TABLE_WISE for n in some})
    if some and tried != kinds:
      other = plan_stacks(tried)
      if moved(other) <= moved(stacks) and fits(other, stacks):
        kinds, stacks = tried, other
  return kinds, stacks
