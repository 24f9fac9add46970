"""The collection's plan: one ``EmbeddingPlan`` per table, chosen together.

Each table is planned by ``plan_embedding`` (the same cost model as
``ShardedEmbed``). One decision is made for the collection as a whole: with
a ``replicate_budget_bytes``, the tables whose replication saves the most
traffic per byte stored are replicated until the budget is spent, instead of
each table being judged alone against ``replicate_below_bytes``. The traffic
of a step is counted per feature (a pooled feature moves its ids and one
pooled row per sample, a sequence feature a row per id) and, for tables with
a dedup capacity, per unique id. A collection is trained with the sparse
optimizers, so an auto table's layout is the one whose step moves the
fewest bytes counting their gathering of row gradients too
(``EmbeddingPlan.sparse_update``): a replicated table looks up for nothing
but all-reduces (or all-gathers) its gradients, a hidden one all-gathers
every rank's full-width gradients, so a small table is replicated, and a
table is split by hidden columns, only where that step moves no more than
the other layouts'. Pure Python: no arrays.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Mapping, Sequence

import numpy as np

from embedlib import options
from embedlib.collection.specs import FeatureSpec, TableSpec
from embedlib.collection import budget as budget_lib
from embedlib.collection import traffic as traffic_lib
from embedlib.collection.traffic import estimate_bytes_moved
from embedlib.collection import stacks as stacks_lib
from embedlib.plan import EmbeddingPlan, cost, memory, mesh_axes, placement, plan_embedding
from embedlib.plan.choose import cheapest, sharded_candidates
from embedlib.plan.report import human_bytes


@dataclasses.dataclass(frozen=True)
class TablePlan:
  """One table's layout and traffic inside a collection.

  Attributes:
    plan: its ``EmbeddingPlan`` (``plan.reason`` says why the layout).
    features: names of the features that read it.
    num_unique: dedup capacity per data shard, or None.
    bytes_moved: estimated bytes per device per step without dedup.
    bytes_moved_dedup: the same with dedup at ``num_unique``, or None.
    bytes_moved_update: bytes per device per step of the sparse optimizers'
      gathering of row gradients (``EmbeddingPlan.sparse_update``).
  """

  plan: EmbeddingPlan
  features: tuple[str, ...]
  num_unique: int | None
  bytes_moved: int
  bytes_moved_dedup: int | None
  bytes_moved_update: int = 0
  name_: str | None = None
  stack: str | None = None
  placed: str = ""

  @property
  def name(self) -> str:
    return self.name_ or self.plan.name

  @property
  def kind(self) -> str:
    """The table's layout: its plan's strategy, or its placement in a stack."""
    if self.stack is None:
      return self.plan.strategy
    p = self.plan.placement
    kind = p.kinds[[m for m, _ in p.members].index(self.name)]
    return options.ROUTED if kind == placement.ROW else kind


@dataclasses.dataclass(frozen=True)
class DynamicTablePlan:
  """A dynamic table of a collection (``embedlib.DynamicEmbed``): its layout and bytes a device.

  Attributes:
    name: the table's name.
    capacity: its rows (``TableSpec.num_embeddings``).
    features: its width.
    strategy: the rows' layout (``vocab``: whole buckets split over
      ``group`` devices; ``replicated``: every device holds them all).
    group: devices the rows and the map are split over.
    bucket_size, admit_after, eviction: its policy (``embedlib.dynamic.policy``).
    rows: bytes of rows a device holds (with a learned default row).
    slots: bytes of the sparse optimizer's slots for those rows.
    map: bytes of the id -> row map a device holds
      (``DynamicEmbed.map_bytes_per_device``).
  """

  name: str
  capacity: int
  features: int
  strategy: str
  group: int
  bucket_size: int
  admit_after: int
  eviction: str | None
  rows: int
  slots: int
  map: int

  @property
  def bytes_per_device(self) -> int:
    return self.rows + self.slots + self.map

  @property
  def note(self) -> str:
    """The policy, in words, printed below the table's row."""
    buckets = self.capacity // self.bucket_size
    where = f"over {self.group} devices" if self.group > 1 else "on each device"
    return (f"{buckets} buckets of {self.bucket_size} {where}; admit_after="
            f"{self.admit_after}, eviction={self.eviction}")


@dataclasses.dataclass(frozen=True)
class CollectionPlan:
  """Every table's plan; prints as one table with the per-device totals.

  >>> tables = [TableSpec("small", 100, 8), TableSpec("big", 1 << 20, 64)]
  >>> feats = [FeatureSpec("a", "small"), FeatureSpec("b", "big", max_ids_per_sample=4)]
  >>> p = plan_collection(tables, feats, mesh={"batch": 8}, batch_size=1024)
  >>> p["small"].plan.strategy, p["big"].plan.strategy
  ('replicated', 'routed')
  >>> print(p)  # doctest: +ELLIPSIS
  EmbeddingCollection plan: 2 tables, mesh batch=8, 1024 samples per step
  table  strategy    padded shape  bytes/device  moved/step  dedup/step  update/step
  small  replicated  100 x 8       3.12 KiB      0 B         -           6.15 KiB
      small table (3.12 KiB <= 1.00 MiB): a copy per device moves 6.15 KiB per step ...
  big    routed      1048576 x 64  32.00 MiB     167.08 KiB  -           167.07 KiB
      moves the fewest bytes per step (lookup and sparse update) ...
  total                            32.00 MiB     167.08 KiB              173.22 KiB
  """

  tables: tuple[TablePlan, ...]
  batch_size: int
  mesh_shape: tuple[tuple[str, int], ...]
  stacks: tuple[stacks_lib.StackPlan, ...] = ()
  #: The dynamic tables, laid out apart from the planner's (whole buckets).
  dynamic: tuple[DynamicTablePlan, ...] = ()

  def __getitem__(self, name: str) -> TablePlan:
    for t in self.tables:
      if t.name == name:
        return t
    raise KeyError(f"no table {name!r} in the plan; tables: {[t.name for t in self.tables]}.")

  def stack(self, name: str) -> stacks_lib.StackPlan:
    for s in self.stacks:
      if s.name == name:
        return s
    raise KeyError(f"no stack {name!r} in the plan; stacks: {[s.name for s in self.stacks]}.")

  @property
  def _apart(self):
    """Tables with a layout of their own, and the stacks."""
    return [t for t in self.tables if t.stack is None] + list(self.stacks)

  @property
  def bytes_per_device(self) -> int:
    return sum(t.plan.bytes_per_device for t in self._apart)

  @property
  def bytes_moved(self) -> int:
    """Per device per step's lookups, with dedup where a table or stack has a capacity."""
    return sum(
        t.bytes_moved if t.bytes_moved_dedup is None else t.bytes_moved_dedup
        for t in self._apart
    )

  @property
  def bytes_moved_update(self) -> int:
    """Per device per step, the sparse optimizers' gathering of row gradients."""
    return sum(t.bytes_moved_update for t in self._apart)

  def __str__(self) -> str:
    """One row of sizes per table or stack, its reason wrapped below it, within 100 columns."""
    mesh = ", ".join(f"{a}={n}" for a, n in self.mesh_shape) or "one device"
    head = ("table", "strategy", "padded shape", "bytes/device", "moved/step", "dedup/step",
            "update/step")
    rows = [(head, "")]  # (cells, the note wrapped below them)
    for t in self.tables:
      if t.stack is not None:
        rows.append(((t.name, t.kind, f"in {t.stack}", "", "", "", ""), t.placed))
        continue
      dedup = "-" if t.bytes_moved_dedup is None else human_bytes(t.bytes_moved_dedup)
      rows.append(((
          t.name, t.kind,
          f"{t.plan.padded_shape[0]} x {t.plan.padded_shape[1]}",
          human_bytes(t.plan.bytes_per_device), human_bytes(t.bytes_moved), dedup,
          human_bytes(t.bytes_moved_update)), (t.plan.reason, _node_note(t))))
    for s in self.stacks:
      dedup = "-" if s.bytes_moved_dedup is None else human_bytes(s.bytes_moved_dedup)
      rows.append(((
          s.name, s.plan.strategy, f"{s.plan.padded_shape[0]} x {s.plan.padded_shape[1]}",
          human_bytes(s.plan.bytes_per_device), human_bytes(s.bytes_moved), dedup,
          human_bytes(s.bytes_moved_update)),
          (f"{len(s.members)} table{'s' if len(s.members) > 1 else ''}, one route per step",
           _node_note(s))))
    rows.append((("total", "", "", human_bytes(self.bytes_per_device),
                  human_bytes(self.bytes_moved), "", human_bytes(self.bytes_moved_update)), ""))
    count = f"{len(self.tables) + len(self.dynamic)} tables"
    if self.dynamic:
      count += f" ({len(self.dynamic)} dynamic)"
    lines = [f"EmbeddingCollection plan: {count}, mesh {mesh}, {self.batch_size} samples per step"]
    if self.tables or not self.dynamic:
      lines += _columns(rows)
    if self.dynamic:
      lines += _columns(_dynamic_rows(self.dynamic))
    for s in self.stacks:
      lines.append(f"{s.name} placement ({s.plan.placement.rows_per_rank} rows per device):")
      for line in s.plan.placement.describe():
        lines += textwrap.wrap(line, PRINT_WIDTH, initial_indent="  ", subsequent_indent="    ",
                               break_on_hyphens=False)
    return "\n".join(lines)


def _dynamic_rows(dynamic) -> list:
  """The dynamic tables' rows for ``_columns``: rows, slots and map a device, with a total."""
  head = ("dynamic table", "strategy", "rows x width", "rows/device", "slots/device",
          "map/device", "bytes/device")
  rows = [(head, "")]
  for d in dynamic:
    rows.append(((d.name, d.strategy, f"{d.capacity} x {d.features}", human_bytes(d.rows),
                  human_bytes(d.slots), human_bytes(d.map), human_bytes(d.bytes_per_device)),
                 d.note))
  total = lambda field: human_bytes(sum(getattr(d, field) for d in dynamic))
  rows.append((("total", "", "", total("rows"), total("slots"), total("map"),
                total("bytes_per_device")), ""))
  return rows


def _node_note(t) -> str:
  """A table's (or stack's) step across nodes, in words; ``""`` on one node."""
  p = t.plan
  if p.nodes == 1:
    return ""
  moved = t.bytes_moved if t.bytes_moved_dedup is None else t.bytes_moved_dedup
  intra, inter = traffic_lib.node_split(p, moved)
  update = traffic_lib.update_node_split(p, p.ids_per_device)[1]
  return (f"across nodes {human_bytes(inter)} per step per device ({human_bytes(intra)} "
          f"inside its node of {p.devices_per_node}; {p.nodes} nodes"
          f"{', two-level route' if p.node_route else ''}); its update {human_bytes(update)} "
          f"across nodes")


#: Columns a printed plan fits in (a terminal, a log line, a code review).
PRINT_WIDTH = 100


def _columns(rows) -> list[str]:
  """``rows`` of ``(cells, notes)`` as aligned columns, each note wrapped below its row.

  Names too long for the row to fit ``PRINT_WIDTH`` go on a line of their own.
  """
  widths = [max(len(cells[i]) for cells, _ in rows) for i in range(len(rows[0][0]))]
  name_apart = sum(widths) + 2 * (len(widths) - 1) > PRINT_WIDTH
  lines = []
  for cells, note in rows:
    if name_apart:
      lines.append(cells[0])
      cells, shown = ("",) + cells[1:], [2] + widths[1:]
    else:
      shown = widths
    lines.append("  ".join(c.ljust(w) for c, w in zip(cells, shown)).rstrip())
    for one in (note,) if isinstance(note, str) else note:
      lines += textwrap.wrap(one, PRINT_WIDTH, initial_indent="    ",
                             subsequent_indent="    ", break_on_hyphens=False)
  return lines


def _given(capacity):
  """A capacity the caller fixed, or None for ``"auto"`` (decided after the layout)."""
  return None if capacity == options.AUTO else capacity


def _bags(features: Sequence[FeatureSpec], table: str):
  return [
      (f.max_ids_per_sample or 1, not f.is_sequence) for f in features if f.table == table
  ]


def plan_collection(
    tables: Sequence[TableSpec],
    features: Sequence[FeatureSpec],
    *,
    mesh=None,
    table_axes=None,
    data_axes=None,
    param_dtype=np.float32,
    batch_size: int = 4096,
    num_unique: Mapping[str, int] | None = None,
    route_capacity: Mapping[str, int] | None = None,
    replicate_below_bytes: int | None = None,
    replicate_budget_bytes: int | None = None,
    table_batched: bool = False,
    devices_per_host: int | None = None,
    device_memory_bytes: int | None = None,
    devices_per_node: int | None = None,
    node_capacity: Mapping[str, int] | None = None,
    optimizer=memory.DEFAULT_OPTIMIZER,
) -> CollectionPlan:
  """Plans every table of a collection (see the module docstring).

  Args:
    tables: the ``TableSpec`` s.
    features: the ``FeatureSpec`` s (their bags set the traffic estimates:
      ``max_ids_per_sample``, or 1 when unset).
    mesh: a ``Mesh``, ``AbstractMesh``, ``{axis: size}`` dict or None.
    table_axes: mesh axes tables are split over (see ``plan_embedding``).
    data_axes: mesh axes the batch is split over.
    param_dtype: dtype of the stored tables.
    batch_size: samples per step over the whole mesh, for the estimates.
    num_unique: dedup capacity per data shard, by table (or stack) name:
      an int, or ``"auto"``: dedup a sharded table or stack when its
      expected distinct ids (for its ``id_skew``) make its lookup move fewer
      bytes, by more than dedup's work on the ids costs
      (``cost.dedup_pays``), the layout chosen with it (the chosen capacity
      is the ``TablePlan`` 's or ``StackPlan`` 's ``num_unique``).
    route_capacity: ids per destination of routed tables, by table name
      (default: from each call's ids, ``EmbeddingPlan.capacity_for``).
    replicate_below_bytes: the per-table auto rule's threshold.
    replicate_budget_bytes: replicate auto tables, most traffic saved per
      byte first, until their copies fill this many bytes per device; the
      rest are sharded. None keeps the per-table rule.
    table_batched: every routed table joins the stack of its width (one
      route per width per step), auto tables too small to split placed
      whole on one device (see ``stacks``); tables asked for ``"table"``
      or ``"table_row"`` are stacked either way.
    devices_per_host: devices of one host, for ``"table_row"`` (default:
      the whole group is one host).
    device_memory_bytes: what a device may spend on the embedding's
      training step: its tables' shards and stack blocks, the
      ``optimizer``'s slots, the ids and the temporaries
      (``budget.step_memory``). An auto table takes the cheapest layout
      whose step fits it alone; the plan raises if the whole doesn't.
    devices_per_node: devices one node holds, for every table and stack
      (see ``plan_embedding``): a routed table or stack over several nodes
      takes the two-level route where it pays, and ``auto`` counts a byte
      of a step (lookup and sparse update) that crosses nodes as
      ``cost.INTER_NODE_WEIGHT`` bytes. None reads it from the devices.
    node_capacity: distinct ids per destination rank one node sends across
      nodes in that route, by table (or stack) name (default: planned for
      the table's ``id_skew``, ``cost.node_capacity``).
    optimizer: the sparse optimizer that trains the tables, for its slots
      (see ``embedlib.plan.memory.slot_layout``).

  Returns:
    A ``CollectionPlan``.
  """
  for what, given in (("num_unique", num_unique), ("route_capacity", route_capacity),
                      ("node_capacity", node_capacity)):
    if given is not None and not isinstance(given, Mapping):
      raise TypeError(
          f"plan_collection: {what} takes a capacity by table (or stack) name, e.g. "
          f"{{'items': {given!r}}}; got {given!r}. EmbeddingCollection also takes one "
          "value for every table.")
  num_unique = dict(num_unique or {})
  route_capacity = dict(route_capacity or {})
  node_capacity = dict(node_capacity or {})
  shape = mesh_axes.mesh_shape(mesh)
  _, data = mesh_axes.resolve_axes(shape, table_axes, data_axes)
  local_batch = math.ceil(batch_size / mesh_axes.axes_size(shape, data))
  common = dict(
      mesh=mesh, table_axes=table_axes, data_axes=data_axes,
      param_dtype=param_dtype, devices_per_node=devices_per_node, optimizer=optimizer,
  )
  if replicate_below_bytes is not None:
    common["replicate_below_bytes"] = replicate_below_bytes

  # Ids per device per step, by table.
  ids = {t.name: local_batch * sum(b for b, _ in _bags(features, t.name)) for t in tables}

  def fits(t, p):
    """Whether ``t``'s step laid out as ``p`` fits ``device_memory_bytes`` alone."""
    if device_memory_bytes is None:
      return True
    n, rows = budget_lib.lookups(features, [t.name], local_batch)
    return p.memory(n, num_unique=_given(num_unique.get(t.name)), rows=rows,
                    optimizer=optimizer).total <= device_memory_bytes

  def dedup(t, p):
    """``t``'s dedup capacity laid out as ``p``: the one given, ``auto``'s choice, or None."""
    given = num_unique.get(t.name)
    if given != options.AUTO:
      return given
    return traffic_lib.dedup_if_it_pays(p, _bags(features, t.name), batch_size=batch_size,
                                        local_batch=local_batch)

  def step_bytes(t, p):
    """A step's lookup and gathering of row gradients, per device, a byte across nodes weighed.

    With ``num_unique="auto"`` each layout is costed with dedup where it
    pays there, dedup's work counted as the bytes ``cost.dedup_pays`` sets
    against it: a layout and its dedup are chosen together.
    """
    cap = dedup(t, p)
    lookup = estimate_bytes_moved(p, _bags(features, t.name), batch_size=batch_size,
                                  num_unique=cap)
    work = cost.DEDUP_BYTES_PER_ID * ids[t.name] if (
        cap is not None and num_unique.get(t.name) == options.AUTO) else 0
    return sum(traffic_lib.weighed(p, lookup, max(ids[t.name], 1))) + work

  def plan(t, **kw):
    p = plan_embedding(
        t.num_embeddings, t.features, name=t.name, ids_per_device=max(ids[t.name], 1),
        route_capacity=route_capacity.get(t.name), node_capacity=node_capacity.get(t.name),
        id_skew=t.id_skew, **{**common, **kw}
    )
    if kw.get("sharding", options.AUTO) != options.AUTO:
      return p
    if p.strategy == options.REPLICATED and kw.get("replicate_below_bytes") != 0:
      # Small enough to copy; copied only if its gradients' all-reduce (or
      # all-gather) moves no more than the best split's lookup and update.
      split = plan(t, **{**kw, "replicate_below_bytes": 0})
      if split.strategy == options.REPLICATED:  # a one-device group
        return p
      copy, best = step_bytes(t, p), step_bytes(t, split)
      if copy <= best and (fits(t, p) or not fits(t, split)):
        return dataclasses.replace(p, reason=(
            f"{p.reason.split(':')[0]}: a copy per device moves {human_bytes(copy)} per step "
            f"gathering its gradients, {split.strategy} {human_bytes(best)}"))
      return dataclasses.replace(split, reason=(
          f"{split.reason}; a copy per device would move {human_bytes(copy)} gathering its "
          f"gradients{', but its step does not fit device_memory_bytes' if copy <= best else ''}"))
    if p.strategy == options.REPLICATED or p.num_embeddings < p.group_size:
      return p
    # Weigh the layouts by this table's features, not by rows per id: a
    # pooled feature moves one pooled row per sample on vocab and hidden.
    candidates, why_not = sharded_candidates(t.num_embeddings, t.features, p.group_size)
    costed = {s: plan(t, **{**kw, "sharding": s}) for s in candidates}
    per = "step (lookup and sparse update)"
    if num_unique.get(t.name) == options.AUTO:
      per += f", with dedup where it pays (its work counted {cost.DEDUP_BYTES_PER_ID} bytes an id)"
    if p.nodes > 1:
      per += f", a byte across nodes counted {cost.INTER_NODE_WEIGHT}x"
    fitting = [s for s in candidates if fits(t, costed[s])] or candidates
    if len(fitting) < len(candidates):
      why_not = "; ".join([w for w in (why_not,) if w] + [
          f"{s}'s step doesn't fit device_memory_bytes" for s in candidates if s not in fitting])
    best, reason = cheapest(fitting, lambda s: step_bytes(t, costed[s]), why_not, per=per)
    return dataclasses.replace(costed[best], reason=reason)

  plans = {}
  if replicate_budget_bytes is not None:
    auto = [t for t in tables if t.sharding == options.AUTO]
    sharded = {t.name: plan(t, replicate_below_bytes=0) for t in auto}
    saved = lambda t: estimate_bytes_moved(
        sharded[t.name], _bags(features, t.name), batch_size=batch_size
    ) / (t.num_embeddings * t.features)
    spent = 0
    for t in sorted(auto, key=saved, reverse=True):
      size = t.num_embeddings * t.features * np.dtype(param_dtype).itemsize
      p = sharded[t.name]
      if p.strategy != options.REPLICATED and spent + size <= replicate_budget_bytes:
        spent += size
        p = dataclasses.replace(
            plan(t, sharding=options.REPLICATED),
            reason=(
                f"collection budget: replicated, the most traffic saved per "
                f"byte ({human_bytes(spent)} of {human_bytes(replicate_budget_bytes)} used)"
            ),
        )
      plans[t.name] = p
  for t in tables:
    if t.name in plans:
      continue
    if t.sharding in options.PLACEMENTS:
      p = plan(t, sharding=options.ROUTED)
      if p.group_size < 2:
        p = dataclasses.replace(plan(t, sharding=options.REPLICATED), reason=(
            f"sharding={t.sharding!r} on a one-device group: the whole table on it"))
      plans[t.name] = p
    elif t.sharding == options.GRID:
      p = plan(t, sharding=t.sharding, column_axes=t.column_axes)
      plans[t.name] = dataclasses.replace(p, reason=(
          f"{p.reason}: rows over {p.table_axes}, columns over {p.column_axes}"))
    else:
      plans[t.name] = plan(t, sharding=t.sharding)
  kinds = {}
  for t in tables:
    kind = stacks_lib.stack_kind(t, plans[t.name], table_batched=table_batched)
    if kind is not None:
      kinds[t.name] = kind
  plan_stacks = lambda kinds: stacks_lib.plan_stacks(
      tables, features, kinds, ids, mesh=mesh, table_axes=table_axes, data_axes=data_axes,
      param_dtype=param_dtype, devices_per_host=devices_per_host, num_unique=num_unique,
      route_capacity=route_capacity, devices_per_node=devices_per_node,
      node_capacity=node_capacity)
  apart = [(plans[t.name], _given(num_unique.get(t.name))) for t in tables if t.name not in kinds]
  step = lambda stacks: budget_lib.step_memory(apart, stacks, features, batch_size=batch_size,
                                               optimizer=optimizer).total
  kinds, stacks = stacks_lib.table_wise_where_it_pays(
      [t for t in tables if stacks_lib.small(t, plans[t.name])], kinds, plan_stacks,
      fits=lambda tried, stacks: device_memory_bytes is None or step(tried) <= max(
          step(stacks), device_memory_bytes))
  stack_of = {m: s for s in stacks for m in s.members}
  out = []
  for t in tables:
    names = tuple(f.name for f in features if f.table == t.name)
    if t.name in stack_of:
      s = stack_of[t.name]
      out.append(TablePlan(plan=s.plan, features=names, num_unique=None, bytes_moved=0,
                           bytes_moved_dedup=None, name_=t.name, stack=s.name,
                           placed=stacks_lib.placed_on(s, t.name)))
      continue
    p = plans[t.name]
    bags = _bags(features, t.name)
    cap = dedup(t, p)
    out.append(TablePlan(
        plan=p,
        features=names,
        num_unique=cap,
        bytes_moved=estimate_bytes_moved(p, bags, batch_size=batch_size),
        bytes_moved_dedup=None if cap is None else estimate_bytes_moved(
            p, bags, batch_size=batch_size, num_unique=cap
        ),
        bytes_moved_update=p.sparse_update(max(ids[t.name], 1))[1],
    ))
  budget_lib.check_memory(budget_lib.step_memory(
      [(t.plan, t.num_unique) for t in out if t.stack is None], stacks, features,
      batch_size=batch_size, optimizer=optimizer), stacks, device_memory_bytes)
  return CollectionPlan(
      tables=tuple(out),
      stacks=tuple(stacks),
      batch_size=batch_size,
      mesh_shape=tuple(mesh_axes.mesh_shape(mesh).items()),
  )
