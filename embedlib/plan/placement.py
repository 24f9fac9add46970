"""Table-wise and table-row-wise placement: small tables whole on one device.

Several tables of one width share one row-split buffer, a *stack* (the
table-batched layout of TorchRec / FBGEMM): device ``d`` holds rows
``[d * rows_per_rank, (d + 1) * rows_per_rank)`` of it, and each member
table's rows sit in one device's block (table-wise), in the blocks of one
host's devices (table-row-wise) or in every device's block (row-wise). A
stack is one routed table: each id goes to the device holding its row and
the row comes back, one route per stack per step whatever the number of
tables in it.

The stack's logical table is its members' logical tables one after the
other (``members``); ``segments`` say where each run of logical rows lives
in the physical buffer. So the logical table (and a checkpoint of it)
doesn't depend on the placement or the device count.

The placement is greedy, as TorchRec's planner: row-wise and table-row-wise
members first, then the table-wise ones, most lookups first, each to the
device where it leaves lookups and rows most balanced. Pure Python.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from embedlib import options
from embedlib.plan import cost

#: Placements of a stack member.
ROW = "row"  # split over every device of the group
KINDS = (ROW, options.TABLE_WISE, options.TABLE_ROW_WISE)


@dataclasses.dataclass(frozen=True)
class Member:
  """A table to place in a stack.

  Attributes:
    name: the table's name.
    rows: its ``num_embeddings``.
    ids_per_device: ids one device looks up in it per step.
    kind: ``"row" | "table" | "table_row"``.
    device: a pinned device (rank in the group) for ``"table"``.
    host: a pinned host for ``"table_row"``.
    lookups: where ``ids_per_device`` counts distinct ids (a deduplicated
      stack), the lookups they come from, per device per step.
    skew: how much its ids repeat (``TableSpec.id_skew``).
  """

  name: str
  rows: int
  ids_per_device: int
  kind: str = ROW
  device: int | None = None
  host: int | None = None
  lookups: int | None = None
  skew: float = 0.0


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where the rows of a stack's member tables live.

  Attributes:
    members: ``(name, rows)`` per member, in logical order.
    segments: ``(logical_start, rows, physical_start)`` runs of rows, in
      logical order; a run never crosses a device's block.
    rows_per_rank: rows of the buffer on each device.
    group: devices in the table group.
    kinds: each member's placement kind.
    ids: each member's ids per device per step (for the route capacity).
    lookups: each member's lookups per device per step, where ``ids``
      counts distinct ones (a deduplicated stack), else None.
    skews: each member's ``id_skew``; empty for uniform ids.
  """

  members: tuple[tuple[str, int], ...]
  segments: tuple[tuple[int, int, int], ...]
  rows_per_rank: int
  group: int
  kinds: tuple[str, ...]
  ids: tuple[int, ...]
  lookups: tuple[int, ...] | None = None
  skews: tuple[float, ...] = ()

  @property
  def num_embeddings(self) -> int:
    return sum(rows for _, rows in self.members)

  def start(self, name: str) -> int:
    """The member's first row in the stack's logical table."""
    start = 0
    for member, rows in self.members:
      if member == name:
        return start
      start += rows
    raise KeyError(f"no table {name!r} in this stack ({[m for m, _ in self.members]}).")

  def devices(self, name: str) -> tuple[int, ...]:
    """The devices holding rows of member ``name``."""
    first = self.start(name)
    rows = dict(self.members)[name]
    return tuple(sorted({
        p // self.rows_per_rank for l, n, p in self.segments if first <= l < first + rows
    }))

  def shares(self, name: str) -> list[float]:
    """Per device, the fraction of the member's rows it holds."""
    first = self.start(name)
    rows = dict(self.members)[name]
    out = [0.0] * self.group
    for l, n, p in self.segments:
      if first <= l < first + rows:
        out[p // self.rows_per_rank] += n / rows
    return out

  def capacity(self, ids_by_member: Mapping[str, int],
               sigmas: float = cost.ROUTE_SLACK_SIGMAS) -> int:
    """Ids per destination for a step with these ids per device per member.

    Per device, the mean of the ids it receives from one rank plus
    ``sigmas`` deviations (a member on one device sends it every id, no
    slack), at most every id that could go there.

    >>> p = place([Member("a", 100, 64, "table", device=0),
    ...            Member("b", 800, 64)], group=2)
    >>> p.capacity({"a": 64, "b": 64})   # device 0: all of a's, half of b's
    112
    """
    worst = 1.0
    for d in range(self.group):
      mean = var = bound = 0.0
      for name, n in ids_by_member.items():
        share = self.shares(name)[d]
        mean += n * share
        var += n * share * (1.0 - share)
        bound += n if share > 0 else 0
      worst = max(worst, min(bound, mean + sigmas * math.sqrt(var)))
    return int(math.ceil(worst - 1e-9))

  def describe(self) -> list[str]:
    """One line per device: the member rows it holds."""
    lines = []
    for d in range(self.group):
      held = []
      for name, rows in self.members:
        first = self.start(name)
        runs = [(l - first, n) for l, n, p in self.segments
                if first <= l < first + rows and p // self.rows_per_rank == d]
        if not runs:
          continue
        if sum(n for _, n in runs) == rows:
          held.append(name)
        else:
          held.extend(f"{name}[{a}:{a + n}]" for a, n in runs)
      used = sum(n for _, n, p in self.segments if p // self.rows_per_rank == d)
      lines.append(f"device {d}: {used} of {self.rows_per_rank} rows: " + (", ".join(held) or "-"))
    return lines


def _split(rows: int, parts: int) -> list[int]:
  chunk = -(-rows // parts)
  return [max(0, min(chunk, rows - i * chunk)) for i in range(parts)]


def place(members: Sequence[Member], *, group: int, devices_per_host: int | None = None,
          name: str = "stack") -> Placement:
  """Places ``members`` on the ``group`` devices of a stack.

  Args:
    members: the tables, in the stack's logical order.
    group: devices in the table group.
    devices_per_host: devices of one host (consecutive ranks); default the
      whole group (one host).
    name: the stack's name, for messages.

  Returns:
    A ``Placement``.

  >>> p = place([Member("a", 10, 64, "table"), Member("b", 10, 8, "table"),
  ...            Member("c", 100, 64)], group=2)
  >>> print("\\n".join(p.describe()))
  device 0: 60 of 60 rows: a, c[0:50]
  device 1: 60 of 60 rows: b, c[50:100]
  """
  # A host with more devices than the group holds the whole group.
  per_host = group if devices_per_host is None else min(devices_per_host, group)
  if per_host < 1 or group % per_host:
    raise ValueError(
        f"{name}: devices_per_host={per_host} does not divide the table group of "
        f"{group} devices; pass the number of devices each host holds."
    )
  hosts = group // per_host
  rows_on = [0] * group
  load = [0.0] * group
  runs: dict[str, list[tuple[int, int, int]]] = {m.name: [] for m in members}

  def put(member, device, offset, rows):
    runs[member.name].append((device, offset, rows))
    rows_on[device] += rows
    load[device] += member.ids_per_device * rows / member.rows

  for m in members:
    if m.kind == ROW:
      offset = 0
      for d, n in enumerate(_split(m.rows, group)):
        if n:
          put(m, d, offset, n)
          offset += n
  for m in members:
    if m.kind != options.TABLE_ROW_WISE:
      continue
    if m.host is not None and not 0 <= m.host < hosts:
      raise ValueError(
          f"table {m.name!r}: host={m.host} is not a host of the table group "
          f"({hosts} hosts of {per_host} devices: 0..{hosts - 1}); pick one of those, "
          f"or host=None to let the planner choose."
      )
    host = m.host if m.host is not None else min(
        range(hosts), key=lambda h: (sum(load[h * per_host:(h + 1) * per_host]),
                                     sum(rows_on[h * per_host:(h + 1) * per_host]), h))
    offset = 0
    for i, n in enumerate(_split(m.rows, per_host)):
      if n:
        put(m, host * per_host + i, offset, n)
        offset += n
  total_ids = sum(m.ids_per_device for m in members) or 1
  total_rows = sum(m.rows for m in members)
  table_wise = [m for m in members if m.kind == options.TABLE_WISE]
  for m in sorted(table_wise, key=lambda m: (-m.ids_per_device, -m.rows, m.name)):
    if m.device is not None:
      if not 0 <= m.device < group:
        raise ValueError(
            f"table {m.name!r}: device={m.device} is not a device of the table group "
            f"({group} devices: 0..{group - 1}); pick one of those, or device=None "
            f"to let the planner place it."
        )
      device = m.device
    else:
      device = min(range(group), key=lambda d: (
          (load[d] + m.ids_per_device) / total_ids + (rows_on[d] + m.rows) / total_rows, d))
    put(m, device, 0, m.rows)
  rows_per_rank = max(1, max(rows_on))
  filled = [0] * group
  segments = []
  start = 0
  for m in members:
    for device, offset, n in runs[m.name]:
      segments.append((start + offset, n, device * rows_per_rank + filled[device]))
      filled[device] += n
    start += m.rows
  return Placement(
      members=tuple((m.name, m.rows) for m in members),
      segments=tuple(sorted(segments)),
      rows_per_rank=rows_per_rank,
      group=group,
      kinds=tuple(m.kind for m in members),
      ids=tuple(m.ids_per_device for m in members),
      lookups=(None if all(m.lookups is None for m in members) else
               tuple(m.ids_per_device if m.lookups is None else m.lookups for m in members)),
      skews=tuple(m.skew for m in members) if any(m.skew for m in members) else (),
  )
