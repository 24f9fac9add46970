"""The sort primitives of every lookup: distinct ids with their inverse, ids bucketed by owner.

Both are one sort of int32 keys and a binary search, and both write their
results with scatters whose indices are distinct (dropped entries each point
past the end at a place of their own), so a GPU needs no atomics. On CPU,
where XLA's sort costs more than the lookup that dedup serves, the distinct
ids come from a C++ kernel instead (``kernels.unique_cpu``: no sort of the
ids), with the same results. Dedup, the routes and the sparse optimizer's
row gradients build on them.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from embedlib.kernels import cpu_library
from embedlib.kernels import platforms
from embedlib.kernels.unique_cpu import unique_cpu

_NO_ID = jnp.iinfo(jnp.int32).max  # sorts after every valid id


def unique_with_inverse(ids, capacity: int):
  """Distinct valid ids of ``ids``, their inverse index and their count.

  Not ``jnp.unique(size=...)``: invalid ids (``-1``) must not use up
  capacity, and the count that detects overflow comes from the same pass.
  On CPU (where the kernels' library builds) the C++ kernel of
  ``kernels.unique_cpu``; elsewhere ``unique_sorted``. Both give the
  distinct ids in increasing order, so the results are the same arrays.

  Args:
    ids: int32 of any shape, ``-1`` for padding and invalid ids (so is
      any negative id, and ``2**31 - 1``, past the largest table).
    capacity: static number of unique slots.

  Returns:
    ``(unique [capacity] int32 padded with -1, inverse ids.shape int32 with
    -1 at invalid ids, count [] int32)``. When ``count > capacity``, the
    inverse of the dropped ids is ``>= capacity`` (a caller must not use it).

  >>> u, inv, n = unique_with_inverse(jnp.array([[7, 3, 7], [-1, 3, 9]]), 4)
  >>> u.tolist(), inv.tolist(), int(n)
  ([3, 7, 9, -1], [[1, 0, 1], [-1, 0, 2]], 3)
  """
  flat = ids.reshape(-1).astype(jnp.int32)
  if flat.shape[0] == 0 or not cpu_library.available():
    unique, inverse, count = unique_sorted(flat, capacity)
  else:
    by_sorting = lambda f: unique_sorted(f, capacity)
    unique, inverse, count = platforms.by_platform(
        flat, cpu=lambda f: unique_cpu(f, capacity), gpu=by_sorting, default=by_sorting)
  return unique, inverse.reshape(ids.shape), count


def unique_sorted(flat, capacity: int):
  """``unique_with_inverse`` of flat int32 ids by one sort: every platform's way but the CPU's.

  The sort has one operand (the ids) and each id finds its place by a
  binary search, as ``optim.apply.dedup`` does: cheaper than sorting the
  ids with their positions (``argsort``).

  >>> u, inv, n = unique_sorted(jnp.array([7, 3, 7, -1, 3, 9]), 2)
  >>> u.tolist(), inv.tolist(), int(n)
  ([3, 7], [1, 0, 1, -1, 0, 2], 3)
  """
  valid = (flat >= 0) & (flat != _NO_ID)  # no table has 2**31 rows
  keys = jnp.where(valid, flat, _NO_ID)
  key = lax.sort(keys)
  first = (key != _NO_ID) & jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
  slot = jnp.cumsum(first, dtype=jnp.int32) - 1
  count = jnp.sum(first, dtype=jnp.int32)
  unique = jnp.full((capacity,), -1, jnp.int32)
  # Repeats point past every slot (past any overflowing slot too), each at
  # its own index: distinct indices, so the scatter needs no atomics on a GPU.
  n = key.shape[0]
  past = capacity + n + jnp.arange(n, dtype=jnp.int32)
  unique = unique.at[jnp.where(first, slot, past)].set(key, mode="drop", unique_indices=True)
  # Each id's first position among the sorted keys holds its slot.
  at = jnp.searchsorted(key, keys, method="scan_unrolled")
  inverse = jnp.where(valid, slot[at], -1)
  return unique, inverse, count


def bucketize(ids, rows_per_rank: int, group: int, capacity: int):
  """Each id's slot in a per-owner send buffer: a route's first step.

  The owners' buckets are found with one stable sort of the owners (the
  ids' positions ride along); an id's place in its bucket is its place in
  the sorted run of its owner, so no two ids of one owner share a slot and
  the earlier ids of a bucket keep the slots when it overflows.

  Args:
    ids: int32 ``[n]`` rows of the (physical) table, ``-1`` for none.
    rows_per_rank: rows each rank owns (row ``r`` lives on ``r // rows_per_rank``).
    group: ranks in the table group.
    capacity: ids per destination.

  Returns:
    ``(send, slot, need)``: ``send`` int32 ``[group * capacity]``, the
    owner-local row of each id in its owner's block (``-1`` in empty
    slots); ``slot`` int32 ``[n]``, where each id's row comes back (``-1``
    for invalid ids and for ids past the capacity); ``need`` int32, the
    largest bucket (the capacity this step needs).

  >>> send, slot, need = bucketize(jnp.array([5, 0, -1, 4, 7]), 4, 2, 2)
  >>> send.tolist(), slot.tolist(), int(need)
  ([0, -1, 1, 0], [2, 0, -1, 3, -1], 3)
  """
  n = ids.shape[0]
  owner = jnp.where(ids >= 0, ids // rows_per_rank, group).astype(jnp.int32)
  iota = jnp.arange(n, dtype=jnp.int32)
  sorted_owner, perm = lax.sort((owner, iota), num_keys=1, is_stable=True)
  starts = jnp.searchsorted(
      sorted_owner, jnp.arange(group + 1, dtype=jnp.int32), method="scan_unrolled"
  ).astype(jnp.int32)
  place = jnp.zeros((n,), jnp.int32).at[perm].set(iota - starts[sorted_owner],
                                                   unique_indices=True)
  need = jnp.max(starts[1:] - starts[:-1])
  kept = (owner < group) & (place < capacity)
  slot = jnp.where(kept, owner * capacity + place, -1)
  local = ids - owner * rows_per_rank
  send = jnp.full((group * capacity,), -1, jnp.int32)
  # Distinct indices, dropped ones each past the end: no atomics on a GPU.
  send = send.at[jnp.where(kept, slot, group * capacity + iota)].set(
      local, mode="drop", unique_indices=True)
  return send, slot, need
