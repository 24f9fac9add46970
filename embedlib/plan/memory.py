"""What a planned table holds on each device in a training step: table, slots, ids, temporaries.

The embedding's own memory, per device: the table's shard, the sparse
row-wise optimizer's slots laid out like it, the step's ids, and the
temporaries of its lookup and sparse update (the exchange buffers of its
layout, the dedup's distinct ids, the update's row gradients and their
route). ``EmbeddingPlan.memory`` gives a table's; ``device_memory`` adds
up a device's; ``auto`` checks a layout's total against
``device_memory_bytes``.

The tables, slots and ids are exact: XLA's compiled memory analysis of the
step counts the same bytes as arguments. The temporaries peak in one of
two phases of the step, whichever holds more: the backward of the
largest lookup (its exchange buffers, with every lookup's returned rows
and per-id bookkeeping still live) or the largest sparse update (its
buffers, with every table's row gradients and ids kept for it); each
layout's buffers are counted from the strategies and the sparse update.
Three constants (``LOOKUP_ID_WORDS``, ``KEPT_ENTRIES``, ``SMALL_BUFFERS``)
are calibrated against compiled programs (``benchmarks/gpu_plan.py --only
memory``; ``benchmarks/README.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from embedlib import options
from embedlib.plan import cost

#: What each sparse row-wise optimizer (``embedlib.optim``) keeps per table:
#: slot name -> (kind, bytes an element). A ``"row"`` slot holds one value
#: per row (``[padded_rows]``), a ``"table"`` slot one per element, laid out
#: like the table.
OPTIMIZER_SLOTS: Mapping[str, Mapping[str, tuple[str, int]]] = {
    "sgd": {},
    "rowwise_adagrad": {"acc": ("row", 4)},
    "lazy_adam": {"m": ("table", 4), "v": ("table", 4), "count": ("row", 4)},
}
DEFAULT_OPTIMIZER = "rowwise_adagrad"

#: In the update phase a step holds each id's row gradient with its id (and
#: the rows looked up) for every table: this many ``(id, row)`` entries an
#: id. Calibrated with ``LOOKUP_ID_WORDS`` on the configs' compiled steps
#: (``benchmarks/README.md``, "Per-device HBM"), where the pair leaves every
#: config's total within 5%.
KEPT_ENTRIES = 2.125

#: In the lookup phase a step holds, for every table, the rows its lookup
#: returned (and their gradients' way back) and this many int32 words an
#: id of the lookup's own bookkeeping (the route's order, positions and
#: masks, kept for the backward; each buffer aligned by XLA's allocator).
LOOKUP_ID_WORDS = 14

#: Bytes of small buffers a table's step holds, by layout: the route's
#: counts, offsets and overflow flags, the update's rounds, each aligned to
#: 256 bytes by XLA's GPU allocator. Calibrated on the smoke configs'
#: compiled steps (routed and vocab tables), where they are most of the
#: temporaries; the other layouts take vocab's (one collective, no route).
SMALL_BUFFERS = {
    options.REPLICATED: 17 << 8,
    options.VOCAB: 17 << 8,
    options.HIDDEN: 17 << 8,
    options.ROUTED: 38 << 8,
    options.GRID: 38 << 8,
}


def slot_layout(optimizer) -> dict[str, tuple[str, int]]:
  """``optimizer``'s slots as ``{name: (kind, bytes an element)}``.

  Args:
    optimizer: a name of ``OPTIMIZER_SLOTS``, None (no sparse optimizer:
      no slots), such a mapping, or a row-wise rule (``embedlib.optim``'s
      ``RowWiseAdagrad``, ...), read through its ``slots()``.

  >>> slot_layout("rowwise_adagrad")
  {'acc': ('row', 4)}
  >>> sorted(slot_layout("lazy_adam"))
  ['count', 'm', 'v']
  """
  if optimizer is None:
    return {}
  if isinstance(optimizer, str):
    if optimizer not in OPTIMIZER_SLOTS:
      raise ValueError(f"optimizer={optimizer!r} has no known slots; use one of "
                       f"{tuple(OPTIMIZER_SLOTS)}, a mapping of slot name to (kind, "
                       f"itemsize), or a row-wise rule.")
    return dict(OPTIMIZER_SLOTS[optimizer])
  if isinstance(optimizer, tuple):  # optimizer_key's form
    optimizer = dict(optimizer)
  if isinstance(optimizer, Mapping):
    return {k: (kind, int(size)) for k, (kind, size) in optimizer.items()}
  slots = optimizer.slots()  # a row-wise rule: Slot(kind, dtype, init)
  return {k: (s.kind, _itemsize(s.dtype)) for k, s in slots.items()}


def optimizer_key(optimizer):
  """``optimizer`` as a plan holds it (hashable): a name, None, or its sorted slot layout.

  >>> optimizer_key({"acc": ("row", 4)})
  (('acc', ('row', 4)),)
  """
  if optimizer is None or isinstance(optimizer, str):
    slot_layout(optimizer)  # an unknown name fails here, naming the known ones
    return optimizer
  return tuple(sorted(slot_layout(optimizer).items()))


def _itemsize(dtype) -> int:
  size = getattr(dtype, "itemsize", None)
  if size is None:  # a jnp scalar type (jnp.float32): its dtype says
    size = dtype(0).dtype.itemsize
  return int(size)


@dataclasses.dataclass(frozen=True)
class TableMemory:
  """One table's (or stack's) bytes on each device in a training step.

  ``temporaries`` are by what holds them (see ``temporaries``); ``map`` is
  a dynamic table's id -> row map (``embedlib.DynamicEmbed``), 0 for others.
  """

  name: str
  table: int
  slots: int
  ids: int
  temporaries: tuple[tuple[str, int], ...]
  map: int = 0

  @property
  def temporary(self) -> int:
    """The temporaries at the step's peak (``peak``)."""
    return peak([dict(self.temporaries)])

  @property
  def total(self) -> int:
    return self.table + self.slots + self.map + self.ids + self.temporary


def slot_bytes(plan, optimizer=DEFAULT_OPTIMIZER) -> int:
  """Bytes of ``optimizer``'s slots for ``plan``'s table on one device.

  Row slots are split with the rows of a row-block layout, and whole on
  each rank of a hidden or replicated one (``embedlib.optim.apply.slot_spec``).

  >>> from embedlib.plan import plan_embedding
  >>> slot_bytes(plan_embedding(1000, 64, mesh={"batch": 8}, sharding="routed"))
  500
  >>> slot_bytes(plan_embedding(1000, 64, mesh={"batch": 8}, sharding="hidden"))
  4000
  """
  rows = plan.padded_shape[0]
  if plan.strategy in options.ROW_BLOCKS:
    rows //= plan.group_size
  total = 0
  for kind, size in slot_layout(optimizer).values():
    if kind == "table":
      total += plan.bytes_per_device * size // plan.itemsize
    else:
      total += rows * size
  return total


def temporaries(plan, ids: int | None = None, *, num_unique: int | None = None,
                rows: int | None = None, optimizer=DEFAULT_OPTIMIZER) -> dict[str, int]:
  """The temporaries of one step of ``plan``'s table on a device, by what holds them.

  ``"lookup"``: the lookup's exchange buffers. A routed lookup holds its
  route's send and receive buffers or, in the in-graph fallback it
  compiles beside them, the group's ids all-gathered and their partial
  rows; a vocab, hidden or grid lookup the latter. ``"returned"``: the
  rows the lookup returns and ``LOOKUP_ID_WORDS`` words an id, live from
  the lookup through its backward. ``"update"``: the sparse update's row
  gradients with their ids and their way to the owners
  (``sparse_update``). ``"kept"``: the ids' row gradients with their ids,
  kept from lookup to update (``KEPT_ENTRIES``). ``"dedup"``: the distinct
  ids and their rows. ``"small"``: ``SMALL_BUFFERS``.

  A device holds one table's exchange buffers at a time (the compiled step
  reuses them from table to table) beside every table's returned rows, or
  one table's update buffers beside every table's kept gradients:
  ``peak`` adds them up.

  Args:
    plan: an ``EmbeddingPlan`` (a table's, or a stack's).
    ids: ids the device looks up a step (default ``plan.ids_per_device``).
    num_unique: the lookup's dedup capacity per data shard, or None.
    rows: rows the lookup returns the device (a row a sample for a pooled
      feature; default ``ids``).
    optimizer: the sparse optimizer (the touched rows' slots travel with
      the update); see ``slot_layout``.

  Returns:
    ``{"lookup", "returned", "update", "kept", "dedup", "small"}`` -> bytes.
  """
  n = plan.ids_per_device if ids is None else ids
  r = n if rows is None else rows
  row = plan.padded_shape[1] * plan.itemsize
  strategy = plan.strategy
  lookup = 0
  if strategy == options.ROUTED:
    routed = n if num_unique is None else min(n, num_unique)
    route = 2 * plan.group_size * plan.capacity_for(routed) * (cost.ID_BYTES + row)
    fallback = plan.group_size * (r * row + n * cost.ID_BYTES)
    lookup = max(route, fallback)
  elif strategy in (options.VOCAB, options.GRID, options.HIDDEN):
    ranks = _token_ranks(plan)
    width = row // (plan.group_size if strategy == options.HIDDEN else
                    plan.column_group_size)
    lookup = ranks * (n * cost.ID_BYTES + r * width)
  way, _ = plan.sparse_update(n)
  slot_row = sum(size * (plan.features if kind == "table" else 1)
                 for kind, size in slot_layout(optimizer).values())
  entry = cost.ID_BYTES + plan.features * plan.itemsize
  update = n * (entry + slot_row)  # row gradients with their ids; the touched rows' slots
  if way == "route":
    update += 2 * plan.group_size * plan.update_capacity(n) * entry
  elif way == "gather":
    update += plan.data_shards * n * entry
  elif way == "allreduce":
    update += plan.padded_shape[0] * (plan.features + 1) * 4
  dedup = 0
  if num_unique is not None:
    dedup = n * cost.ID_BYTES + min(n, num_unique) * (cost.ID_BYTES + row)
  returned = r * plan.features * plan.itemsize + LOOKUP_ID_WORDS * 4 * n
  return {"lookup": lookup, "returned": returned, "update": update,
          "kept": int(KEPT_ENTRIES * n * entry), "dedup": dedup,
          "small": SMALL_BUFFERS[strategy]}


def peak_parts(tables) -> dict[str, int]:
  """What a device holds at the step's temporaries' peak for ``tables`` (``temporaries`` dicts).

  The larger of the two phases: one table's lookup buffers beside every
  table's returned rows (``{"lookup", "returned"}``), or one table's update
  buffers beside every table's kept gradients (``{"update", "kept"}``);
  with every table's ``"dedup"`` and ``"small"`` buffers.

  >>> peak_parts([{"lookup": 10, "returned": 1, "update": 4, "kept": 2, "dedup": 0, "small": 1}] * 2)
  {'lookup': 10, 'returned': 2, 'dedup': 0, 'small': 2}
  """
  tables = list(tables)
  total = lambda k: sum(t[k] for t in tables)
  largest = lambda k: max((t[k] for t in tables), default=0)
  lookup = {"lookup": largest("lookup"), "returned": total("returned")}
  update = {"update": largest("update"), "kept": total("kept")}
  phase = lookup if sum(lookup.values()) > sum(update.values()) else update
  return {**phase, "dedup": total("dedup"), "small": total("small")}


def peak(tables) -> int:
  """The temporaries a device holds at once for ``tables``: ``peak_parts`` added up."""
  return sum(peak_parts(tables).values())


def _token_ranks(plan) -> int:
  shape = dict(plan.mesh_shape)
  ranks = 1
  for a in plan.token_axes + plan.column_token_axes:
    ranks *= shape[a]
  return ranks


def table_memory(plan, ids: int | None = None, *, num_unique: int | None = None,
                 rows: int | None = None, optimizer=DEFAULT_OPTIMIZER) -> TableMemory:
  """``plan``'s table, slots, ids and temporaries on one device (see ``temporaries``).

  >>> from embedlib.plan import plan_embedding
  >>> m = table_memory(plan_embedding(1_000_000, 64, mesh={"batch": 8}, sharding="routed",
  ...                                 ids_per_device=256))
  >>> m.table, m.slots, m.ids
  (32000000, 500000, 1024)
  """
  n = plan.ids_per_device if ids is None else ids
  return TableMemory(
      name=plan.name, table=plan.bytes_per_device, slots=slot_bytes(plan, optimizer),
      ids=n * cost.ID_BYTES,
      temporaries=tuple(temporaries(plan, n, num_unique=num_unique, rows=rows,
                                    optimizer=optimizer).items()))


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """A device's share of an embedding's step: every table's ``TableMemory`` and their sums."""

  tables: tuple[TableMemory, ...]
  optimizer: str

  @property
  def table(self) -> int:
    return sum(t.table for t in self.tables)

  @property
  def slots(self) -> int:
    return sum(t.slots for t in self.tables)

  @property
  def ids(self) -> int:
    return sum(t.ids for t in self.tables)

  @property
  def map(self) -> int:
    """The dynamic tables' maps (0 without dynamic tables)."""
    return sum(t.map for t in self.tables)

  @property
  def temporary(self) -> int:
    """The temporaries at the step's peak over every table (``peak``)."""
    return peak(dict(t.temporaries) for t in self.tables)

  @property
  def total(self) -> int:
    return self.table + self.slots + self.map + self.ids + self.temporary

  def describe(self) -> list[str]:
    """One line per table and one for the device, as plans print bytes."""
    from embedlib.plan.report import human_bytes  # pylint: disable=g-import-not-at-top

    maps = any(t.map for t in self.tables)
    line = lambda name, t, s, m, i, tmp, tot: (
        f"{name:24s} table {human_bytes(t):>11s}  slots {human_bytes(s):>11s}  "
        + (f"map {human_bytes(m):>11s}  " if maps else "")
        + f"ids {human_bytes(i):>11s}  temporaries {human_bytes(tmp):>11s}  total "
        f"{human_bytes(tot):>11s}")
    out = [line(t.name, t.table, t.slots, t.map, t.ids, t.temporary, t.total)
           for t in self.tables]
    out.append(line(f"per device ({self.optimizer})", self.table, self.slots, self.map,
                    self.ids, self.temporary, self.total))
    return out


def device_memory(items, optimizer=DEFAULT_OPTIMIZER) -> DeviceMemory:
  """A device's memory for the embedding's step.

  Args:
    items: ``EmbeddingPlan`` s, or ``(plan, ids, num_unique, rows)`` (a
      collection's table or stack with the ids it looks up a step, its
      dedup capacity and the rows it returns), once each.
    optimizer: the sparse optimizer (see ``slot_layout``).

  >>> from embedlib.plan import plan_embedding
  >>> p = plan_embedding(1_000_000, 64, mesh={"batch": 8}, sharding="routed")
  >>> device_memory([p, p]).table == 2 * p.bytes_per_device
  True
  """
  tables = []
  for item in items:
    plan, ids, num_unique, rows = item if isinstance(item, tuple) else (item, None, None, None)
    tables.append(table_memory(plan, ids, num_unique=num_unique, rows=rows,
                               optimizer=optimizer))
  name = optimizer if isinstance(optimizer, str) or optimizer is None else type(optimizer).__name__
  return DeviceMemory(tuple(tables), str(name))
