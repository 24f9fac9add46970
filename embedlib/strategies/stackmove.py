"""A stack's rows between its logical and physical layouts, shard to shard.

A stack (``plan.placement``) keeps its member tables' rows where the
placement says: the physical buffer's block ``e`` holds some runs of the
logical table, from anywhere in it. ``rowmap.to_physical`` moves them by a
gather, which XLA partitions by replicating its operand: every device then
holds the whole logical stack. Here the logical table is split by rows over
the stack's devices instead (``logical_rows`` rows each, the last padded),
and its rows reach their physical block by rounds of ``lax.ppermute``: for
shift ``k`` device ``d`` sends device ``(d + k) % group`` the rows it holds
of that device's block, in rounds of at most half a block. Every round is
static (its pieces come from ``placement.segments``) and reads what the
previous one wrote, so they run one after the other and a device holds its
logical block, its physical block and one round's buffers. The reverse
(``to_logical``) runs the same rounds backwards.

Inside a round a device finds its pieces (static per device, picked by
``axis_index``) with a ``searchsorted``, as ``rowmap`` does: no row-index
table is stored in the program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from embedlib import sharding as sharding_lib
from embedlib.strategies import runner


@dataclasses.dataclass(frozen=True)
class _Round:
  """One round of a shift: per device ``d``, what ``d`` sends ``(d + shift) % group``.

  ``starts[d]``, ``logical[d]``, ``physical[d]``: each piece's offset in the
  round's buffer (padding pieces start at ``size``, past every buffer row),
  its first row in ``d``'s logical block and in the receiver's physical
  block; ``totals[d]``: rows ``d`` sends; ``size``: the buffer's rows, the
  same in every round.
  """

  shift: int
  size: int
  starts: np.ndarray
  logical: np.ndarray
  physical: np.ndarray
  totals: np.ndarray


def logical_rows(placement) -> int:
  """Rows of the logical stack each device holds (the last device's padded)."""
  return -(-placement.num_embeddings // placement.group)


@functools.lru_cache(maxsize=64)
def schedule(placement) -> tuple[_Round, ...]:
  """The rounds moving ``placement``'s logical blocks to its physical blocks."""
  group, per_rank, per_device = placement.group, placement.rows_per_rank, logical_rows(placement)
  pieces = {}  # (shift, sender) -> [(logical offset, physical offset, rows)]
  for l, n, p in placement.segments:
    while n:
      d, e = l // per_device, p // per_rank
      take = min(n, (d + 1) * per_device - l)  # a segment may cross logical blocks
      piece = (l - d * per_device, p - e * per_rank, take)
      pieces.setdefault(((e - d) % group, d), []).append(piece)
      l, p, n = l + take, p + take, n - take
  lists = {k: [] for k in range(group)}  # shift -> per sender, [(buffer offset, lo, po, rows)]
  for shift in range(group):
    for d in range(group):
      offset, placed = 0, []
      for lo, po, n in pieces.get((shift, d), []):
        placed.append((offset, lo, po, n))
        offset += n
      lists[shift].append(placed)
  largest = max((sum(p[3] for p in ps) for l in lists.values() for ps in l), default=0)
  # Every round moves the same rows (one buffer size: the buffers of
  # successive rounds share memory), at most half a block: a device holds
  # its two blocks and about one block of buffers.
  size = max(1, min(largest, -(-min(per_device, per_rank) // 2)))
  rounds = []
  for shift in range(group):
    for chunk in range(0, max(sum(p[3] for p in ps) for ps in lists[shift]), size):
      cut = [[(max(o, chunk) - chunk, lo + max(o, chunk) - o, po + max(o, chunk) - o,
               min(o + n, chunk + size) - max(o, chunk))
              for o, lo, po, n in ps if o < chunk + size and o + n > chunk] for ps in lists[shift]]
      width = max(len(ps) for ps in cut)
      starts = np.full((group, width), size, np.int32)
      logical = np.zeros((group, width), np.int32)
      physical = np.zeros((group, width), np.int32)
      for d, ps in enumerate(cut):
        for i, (o, lo, po, _) in enumerate(ps):
          starts[d, i], logical[d, i], physical[d, i] = o, lo, po
      totals = np.array([sum(p[3] for p in ps) for ps in cut], np.int32)
      rounds.append(_Round(shift, size, starts, logical, physical, totals))
  return tuple(rounds)


def _rows(round_, device, column, size, missing):
  """The ``size`` rows of ``device``'s pieces in ``column`` (``missing`` past its total)."""
  starts = jnp.asarray(round_.starts)[device]
  first = jnp.asarray(column)[device]
  j = jnp.arange(size, dtype=jnp.int32)
  piece = jnp.clip(jnp.searchsorted(starts, j, side="right") - 1, 0, starts.shape[0] - 1)
  rows = first[piece] + j - starts[piece]
  return jnp.where(j < jnp.asarray(round_.totals)[device], rows, missing)


def _move(local, *, rounds, axes, group, out_rows, forward):
  """One device's block of the other layout, from its block ``local`` of this one."""
  me = lax.axis_index(axes)
  held = local.shape[0]
  # One array holds both blocks, so each round reads what the previous one
  # wrote: a true dependency that orders the rounds (XLA:CPU drops
  # optimization barriers), and one round's buffers live at a time.
  state = jnp.concatenate([local, jnp.zeros((out_rows, local.shape[1]), local.dtype)])
  for r in rounds:
    # Forward: the logical block ``me`` sends to ``me + shift``. Backward: the
    # physical block ``me`` sends back to ``me - shift``, whose pieces these are.
    sender = me if forward else (me - r.shift) % group
    receiver = (me - r.shift) % group if forward else me
    read, write = (r.logical, r.physical) if forward else (r.physical, r.logical)
    # Rows past the sender's total are whatever the clipped index reads: the
    # receiver's index for them is past its block, so the scatter drops them.
    buf = state.at[_rows(r, sender, read, r.size, held)].get(mode="clip")
    if r.shift:
      step = r.shift if forward else -r.shift
      buf = lax.ppermute(buf, axes, [(d, (d + step) % group) for d in range(group)])
    state = state.at[held + _rows(r, receiver, write, r.size, out_rows)].set(buf, mode="drop")
  return state[held:]


def _run(x, plan, mesh, *, forward, out_rows):
  placement = plan.placement
  axes = tuple(plan.table_axes)
  spec = P(axes, None)
  body = functools.partial(_move, rounds=schedule(placement), axes=axes,
                           group=placement.group, out_rows=out_rows, forward=forward)
  x = sharding_lib.place(x, mesh, spec)
  return runner.shard(body, (x,), spec, spec, mesh=mesh)


def to_physical(x, plan, mesh):
  """The physical stack from its logical ``[num_embeddings, features]`` rows.

  ``x`` is placed split by rows over the stack's devices; the result is
  ``plan.padded_shape``, laid out as ``plan.table_spec``. Traceable.
  """
  placement = plan.placement
  _check(plan)
  group, per_device = placement.group, logical_rows(placement)
  rows, cols = plan.padded_shape
  x = jnp.pad(x, ((0, group * per_device - x.shape[0]), (0, 0)))
  out = _run(x, plan, mesh, forward=True, out_rows=placement.rows_per_rank)
  return jnp.pad(out, ((0, 0), (0, cols - x.shape[1]))) if cols > x.shape[1] else out


def to_logical(table, plan, mesh):
  """The logical stack ``[group * logical_rows, features]``, split by rows.

  Rows past ``num_embeddings`` are zero (the last device's padding); slice
  them off where an uneven split is allowed. Traceable.
  """
  placement = plan.placement
  _check(plan)
  return _run(table[:, :plan.features], plan, mesh, forward=False,
              out_rows=logical_rows(placement))


def _check(plan):
  placement = plan.placement
  sizes = dict(plan.mesh_shape)
  devices = int(np.prod([sizes[a] for a in plan.table_axes])) if plan.table_axes else 1
  rows = placement.group * placement.rows_per_rank
  if devices != placement.group or plan.padded_shape[0] != rows:
    raise ValueError(
        f"{plan.name}: the stack's placement is for {placement.group} devices of "
        f"{placement.rows_per_rank} rows, but its plan splits {plan.padded_shape[0]} rows "
        f"over {devices} devices (table_axes {plan.table_axes}); plan the stack and its "
        f"placement for the same table group."
    )


def member(rows, plan, mesh, start: int, length: int):
  """Logical rows ``[start, start + length)`` on every device, from ``to_logical``'s split rows.

  Each device writes the rows it holds into a member-sized block of zeros
  and the blocks are summed: a device holds its logical block and two
  member-sized buffers, never the stack. Traceable.
  """
  per_device = logical_rows(plan.placement)
  axes = tuple(plan.table_axes)

  def body(local):
    me = lax.axis_index(axes)
    row = jnp.arange(length, dtype=jnp.int32) + start - me * per_device
    mine = (row >= 0) & (row < per_device)
    block = local.at[jnp.where(mine, row, per_device)].get(mode="fill", fill_value=0)
    return lax.psum(block, axes)

  rows = sharding_lib.place(rows, mesh, P(axes, None))
  return runner.shard(body, (rows,), P(axes, None), P(), mesh=mesh)
