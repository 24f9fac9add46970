"""One shard's step of the dynamic map: the policy of ``policy.py``, vectorised.

``lookup`` and ``admit_step`` run on the buckets one device owns (all of
them off a mesh), with the step's ids already marked by owner. No loop
runs over ids: the step's ids are sorted by (bucket, id), so distinct ids
are runs and each bucket's admitted ids come in ascending order; the r-th
admitted id of a bucket takes the r-th slot in the order free slots (by
slot), then untouched residents by (score, slot): what placing them one by
one (lowest free slot, else the minimum-score untouched resident) gives.

A resident is found by comparing an id with its bucket's ``bucket_size``
keys (HierarchicalKV's bucket scan): ``bucket_size`` compares per id.

On CPU the training step runs as a C++ kernel instead
(``kernels.dynamic_map_cpu``: a counting sort by bucket and a pass per
bucket, no sort of the whole step, buckets split over the cores), with the
same results bit for bit; ``kernel="xla"`` keeps the ops above.
"""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
from jax import lax

from embedlib.dynamic import ids as ids_lib
from embedlib.dynamic import policy as policy_lib
from embedlib.kernels import cpu_library
from embedlib.kernels import dynamic_map_cpu
from embedlib.kernels import platforms

INT_MAX = 2**31 - 1
#: ``kernel=`` values: the CPU kernel where it applies, or the XLA ops everywhere.
KERNELS = ("auto", "xla")


class MapState(tp.NamedTuple):
  """One shard's map: ``keys_hi``, ``keys_lo`` uint32 ``[rows]``; ``score`` int32
  ``[rows]`` (``-1``: free); ``sketch`` uint8 ``[buckets, depth, width]`` or None."""

  keys_hi: jax.Array
  keys_lo: jax.Array
  score: jax.Array
  sketch: tp.Any


class Sorted(tp.NamedTuple):
  bucket: jax.Array     # local bucket, clipped into range
  own: jax.Array        # this shard owns the id (and it is not padding)
  hi: jax.Array
  lo: jax.Array
  perm: jax.Array       # sorted position -> original position
  first: jax.Array      # first of its run of equal ids
  count: jax.Array      # occurrences of the id in the step
  lead: jax.Array       # sorted position of its run's first
  resident: jax.Array
  slot: jax.Array       # its local slot where resident


def _sort(state: MapState, hi, lo, own, bucket, bucket_size) -> Sorted:
  m = hi.shape[0]
  nbl = state.score.shape[0] // bucket_size
  key_b = jnp.where(own, bucket, nbl)
  s_b, s_hi, s_lo, perm = lax.sort(
      (key_b, jnp.where(own, hi, 0), jnp.where(own, lo, 0), jnp.arange(m, dtype=jnp.int32)),
      num_keys=3)
  change = (s_b[1:] != s_b[:-1]) | (s_hi[1:] != s_hi[:-1]) | (s_lo[1:] != s_lo[:-1])
  first = jnp.concatenate([jnp.ones((min(m, 1),), bool), change])
  run = jnp.cumsum(first) - 1
  count = jax.ops.segment_sum(jnp.ones((m,), jnp.int32), run, m)[run]
  pos = jnp.arange(m, dtype=jnp.int32)
  lead = lax.cummax(jnp.where(first, pos, 0))
  s_own = s_b < nbl
  sb = jnp.minimum(s_b, nbl - 1)
  resident, slot = _scan(state, sb, s_hi, s_lo, bucket_size)
  return Sorted(sb, s_own, s_hi, s_lo, perm, first, count, lead, s_own & resident, slot)


def _scan(state: MapState, bucket, hi, lo, bucket_size):
  """Whether each id is resident in its bucket, and its slot there (any where not).

  Each id reads its bucket's keys and scores as whole rows of the
  ``[buckets, bucket_size]`` views: a gather of contiguous rows, not of
  ``bucket_size`` scattered elements per id.
  """
  nbl = state.score.shape[0] // bucket_size
  rows = lambda v: v.reshape(nbl, bucket_size)[bucket]
  match = ((rows(state.keys_hi) == hi[:, None]) & (rows(state.keys_lo) == lo[:, None])
           & (rows(state.score) >= 0))
  slot = bucket * bucket_size + jnp.argmax(match, axis=1).astype(jnp.int32)
  return match.any(axis=1), slot


def _unsort(s: Sorted, values, fill):
  """Values at sorted positions (read from each run's first) back in input order."""
  values = values[s.lead]
  return jnp.full(values.shape, fill, values.dtype).at[s.perm].set(values)


def lookup(state: MapState, hi, lo, own, bucket, *, bucket_size: int, kernel: str = "auto"):
  """Local rows of the ids (``-1``: not resident here), changing nothing.

  Nothing is placed, so each id is looked up where it stands: no sort. On
  CPU (``kernel="auto"``) a C++ kernel scans the buckets, with the same rows.
  """
  if kernel not in KERNELS:
    raise ValueError(f"kernel={kernel!r} is not a map kernel; use one of {KERNELS}.")
  args = (state.keys_hi, state.keys_lo, state.score, hi, lo, own, bucket)
  xla = functools.partial(_lookup_xla, bucket_size=bucket_size)
  if kernel == "xla" or hi.shape[0] == 0 or not cpu_library.available():
    return xla(*args)
  cpu = functools.partial(dynamic_map_cpu.lookup_cpu, bucket_size=bucket_size)
  return platforms.by_platform(*args, cpu=cpu, gpu=xla, default=xla)


def _lookup_xla(keys_hi, keys_lo, score, hi, lo, own, bucket, *, bucket_size):
  state = MapState(keys_hi, keys_lo, score, None)
  nbl = state.score.shape[0] // bucket_size
  resident, slot = _scan(state, jnp.clip(bucket, 0, nbl - 1), hi, lo, bucket_size)
  return jnp.where(own & resident, slot, -1)


def _victims(key, s: Sorted, rank, free, b):
  """The slot of each id's ``rank - free``-th smallest untouched resident (score, slot).

  ``key``: each slot's score where it may be evicted, else ``INT_MAX``.
  While every such score fits beside a slot number in 31 bits (LRU clocks
  below ``2**24`` with buckets of 128), one key-only sort of (score, slot)
  words per bucket gives the victims; past that, a slower exact search.
  """
  bits = max(1, (b - 1).bit_length())
  limit = 1 << (31 - bits)
  fits = jnp.max(jnp.where(key < INT_MAX, key, 0)) < limit
  return lax.cond(fits, lambda: _victims_packed(key, s, rank, free, b, bits),
                  lambda: _victims_search(key, s, rank, free, b))


def _victims_packed(key, s: Sorted, rank, free, b, bits):
  nbl = key.shape[0] // b
  within = jnp.arange(key.shape[0], dtype=jnp.int32) % b
  packed = jnp.where(key < INT_MAX, (key << bits) | within, INT_MAX)
  ordered = lax.sort(packed.reshape(nbl, b), dimension=1)
  j = jnp.clip(rank - free[s.bucket], 0, b - 1)
  return s.bucket * b + (ordered[s.bucket, j] & ((1 << bits) - 1))


def _victims_search(key, s: Sorted, rank, free, b):
  # A stable sort of each bucket's keys carrying the slots: equal scores keep
  # slot order. Per bucket, not per id, so no [ids, bucket_size] temporaries.
  nbl = key.shape[0] // b
  within = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32), (nbl, b))
  _, slots = lax.sort((key.reshape(nbl, b), within), dimension=1, is_stable=True, num_keys=1)
  j = jnp.clip(rank - free[s.bucket], 0, b - 1)
  return s.bucket * b + slots[s.bucket, j]


def admit_step(state: MapState, hi, lo, own, bucket, clock, *, policy: policy_lib.Policy,
               kernel: str = "auto"):
  """One step of the admission policy on this shard's buckets: touch, admit, place, evict.

  The id map's step (a lookup in training mode runs it), not the model's
  optimizer step (``embedlib.training.train_step``).

  Args:
    state: this shard's ``MapState``.
    hi, lo: uint32 ``[m]`` id words.
    own: bool ``[m]``: the id is this shard's (and not padding).
    bucket: int32 ``[m]``: its bucket, local to this shard (any value where
      not ``own``).
    clock: int32 scalar, the clock before this step.
    policy: the table's ``Policy``.
    kernel: ``"auto"``: on CPU the C++ kernel of
      ``kernels.dynamic_map_cpu`` where the CPU kernels' library loads, else
      (and on every other platform) the XLA ops below; ``"xla"``: the XLA
      ops everywhere. The results are the same bit for bit.

  Returns:
    ``(state, rows, placed, stats)``: the new state; int32 ``[m]`` local
    rows (``-1``: not resident); bool ``[m]``, true at the first occurrence
    (in input order) of each id placed this step; int32 ``[4]`` (resident
    rows, admitted, evicted, lookups reading the default).
  """
  if kernel not in KERNELS:
    raise ValueError(f"{policy.name}: kernel={kernel!r} is not a map kernel; use one of "
                     f"{KERNELS}.")
  args = (state, hi, lo, own, bucket, clock)
  xla = functools.partial(_admit_step_xla, policy=policy)
  if kernel == "xla" or hi.shape[0] == 0 or not cpu_library.available():
    return xla(*args)
  return platforms.by_platform(*args, cpu=functools.partial(_admit_step_cpu, policy=policy),
                               gpu=xla, default=xla)


def _admit_step_cpu(state: MapState, hi, lo, own, bucket, clock, *, policy):
  khi, klo, score, sketch, rows, placed, stats = dynamic_map_cpu.map_step_cpu(
      *cpu_operands(state, hi, lo, own, bucket, clock, policy), **cpu_attributes(policy))
  return MapState(khi, klo, score, sketch), rows, placed, stats


def cpu_operands(state: MapState, hi, lo, own, bucket, clock, policy) -> tuple:
  """``admit_step``'s arguments as the CPU kernel's (``dynamic_map_cpu.map_step_cpu``)."""
  cells = None
  if state.sketch is not None:
    cells = jnp.stack([ids_lib.sketch_cell(hi, lo, r, policy.width)
                       for r in range(policy.sketch_depth)], axis=1)
  return (*state, hi, lo, own, jnp.where(own, bucket, 0), cells, clock)


def cpu_attributes(policy: policy_lib.Policy) -> dict:
  """The policy as the CPU kernel's keyword arguments."""
  return dict(bucket_size=policy.bucket_size, eviction=policy.eviction,
              admit_after=policy.admit_after, decay_every=policy.decay_every)


def _admit_step_xla(state: MapState, hi, lo, own, bucket, clock, *, policy):
  b = policy.bucket_size
  rows_n = state.score.shape[0]
  nbl = rows_n // b
  t = clock + 1
  score, sketch = state.score, state.sketch
  if policy.decay_every > 0:
    decays = (t % policy.decay_every) == 0
    if policy.eviction == policy_lib.LFU:
      score = jnp.where(decays & (score > 0), score >> 1, score)
    if sketch is not None:
      sketch = jnp.where(decays, sketch >> 1, sketch)
  state = state._replace(score=score)
  s = _sort(state, hi, lo, own, bucket, b)
  uniq = s.first & s.own
  touch = jnp.where(uniq & s.resident, s.slot, rows_n)
  if policy.eviction == policy_lib.LFU:
    old = score[s.slot]
    score = score.at[touch].set(jnp.where(old > INT_MAX - s.count, INT_MAX, old + s.count),
                                mode="drop")
  else:
    score = score.at[touch].set(t, mode="drop")
  touched = jnp.zeros((rows_n,), bool).at[touch].set(True, mode="drop")
  cand = uniq & ~s.resident
  if sketch is not None:
    add = jnp.where(cand, s.count, 0)
    wide = sketch.astype(jnp.int32)
    cells = [ids_lib.sketch_cell(s.hi, s.lo, r, policy.width) for r in range(policy.sketch_depth)]
    for r, c in enumerate(cells):
      wide = wide.at[s.bucket, r, c].add(add)
    sketch = jnp.minimum(wide, 255).astype(jnp.uint8)
    est = jnp.min(jnp.stack([sketch[s.bucket, r, c] for r, c in enumerate(cells)]), axis=0)
    cand = cand & (est.astype(jnp.int32) >= policy.admit_after)
  per_bucket = jax.ops.segment_sum(cand.astype(jnp.int32), s.bucket, nbl)
  before = jnp.cumsum(per_bucket) - per_bucket
  rank = jnp.cumsum(cand.astype(jnp.int32)) - 1 - before[s.bucket]
  # No slot is ever freed, so a bucket's free slots are the suffix after
  # its residents: the r-th admitted id takes slot `residents + r` while
  # free ones last, then the (r - free)-th smallest (score, slot) among the
  # untouched residents. The scores are sorted alone (a key-only sort of
  # each bucket); the slot holding the j-th smallest is found by a scan of
  # the id's bucket, as the residents are.
  occupied = (score >= 0).reshape(nbl, b)
  residents = occupied.sum(axis=1).astype(jnp.int32)
  free = b - residents
  fresh = rank < free[s.bucket]
  slot = s.bucket * b + jnp.minimum(residents[s.bucket] + rank, b - 1)
  avail = free
  if policy.eviction is not None:
    key = jnp.where((score >= 0) & ~touched, jnp.minimum(score, INT_MAX - 1), INT_MAX)
    usable = (key < INT_MAX).reshape(nbl, b).sum(axis=1).astype(jnp.int32)
    avail = free + usable
    # A step whose admitted ids all find free slots skips the victims' search.
    evicts = jnp.any(cand & ~fresh & (rank < avail[s.bucket]))
    slot = lax.cond(evicts, lambda: jnp.where(fresh, slot, _victims(key, s, rank, free, b)),
                    lambda: slot)
  placed = cand & (rank < avail[s.bucket])
  evicted = placed & (score[slot] >= 0)
  put = jnp.where(placed, slot, rows_n)
  new_score = jnp.full_like(s.count, t) if policy.eviction != policy_lib.LFU else s.count
  state = MapState(
      keys_hi=state.keys_hi.at[put].set(s.hi, mode="drop"),
      keys_lo=state.keys_lo.at[put].set(s.lo, mode="drop"),
      score=score.at[put].set(new_score, mode="drop"),
      sketch=sketch)
  row = jnp.where(s.resident, s.slot, jnp.where(placed, slot, -1))
  row = jnp.where(s.own, row[s.lead], -1)
  stats = jnp.stack([
      jnp.sum(state.score >= 0), jnp.sum(placed), jnp.sum(evicted),
      jnp.sum(s.own & (row < 0))]).astype(jnp.int32)
  # The sort need not be stable: each run's first input position is its
  # smallest `perm`, where `placed` is marked.
  m = placed.shape[0]
  first_at = jnp.full((m,), m, jnp.int32).at[s.lead].min(s.perm)
  placed_out = jnp.zeros((m,), bool).at[jnp.where(placed & s.first, first_at, m)].set(
      True, mode="drop")
  rows_out = jnp.full(row.shape, -1, jnp.int32).at[s.perm].set(row)
  return state, rows_out, placed_out, stats
