"""The dynamic table's policy in plain Python: a dict per bucket, one id at a time.

The oracle for every layout of ``DynamicEmbed`` (see ``policy`` for the
rules): written from the rules, not from the vectorised step, so the two
agree only if both follow them.
"""

from __future__ import annotations

import numpy as np

from embedlib.dynamic import ids as ids_lib
from embedlib.dynamic import policy as policy_lib

PAD = 2**64 - 1
INT_MAX = 2**31 - 1


def as_uint64(raw) -> list[int]:
  """Raw ids (any integer dtype) as Python ints in ``[0, 2**64)`` (two's complement)."""
  w = ids_lib.host_words(np.asarray(raw).reshape(-1))
  return [(int(h) << 32) | int(l) for h, l in w.reshape(-1, 2)]


def bucket(i: int, num_buckets: int) -> int:
  hi = np.array([i >> 32], np.uint32)
  lo = np.array([i & 0xFFFFFFFF], np.uint32)
  return int(ids_lib.bucket_of(hi, lo, num_buckets, np)[0])


def cell(i: int, row: int, width: int) -> int:
  hi = np.array([i >> 32], np.uint32)
  lo = np.array([i & 0xFFFFFFFF], np.uint32)
  return int(ids_lib.sketch_cell(hi, lo, row, width, np)[0])


class Reference:
  """The map of one dynamic table: ``step(ids)`` gives each id's row (or -1)."""

  def __init__(self, policy: policy_lib.Policy):
    self.p = policy
    nb, b = policy.num_buckets, policy.bucket_size
    self.where = [dict() for _ in range(nb)]      # id -> slot within its bucket
    self.key = [[None] * b for _ in range(nb)]    # slot -> id
    self.score = [[0] * b for _ in range(nb)]
    self.sketch = np.zeros((nb, policy.sketch_depth, policy.width), np.int64)
    self.clock = 0
    self.stats = {}

  def lookup(self, ids: list[int]) -> list[int]:
    """Rows of ``ids`` without changing anything (eval mode)."""
    out = []
    for i in ids:
      if i == PAD:
        out.append(-1)
        continue
      b = bucket(i, self.p.num_buckets)
      s = self.where[b].get(i)
      out.append(-1 if s is None else b * self.p.bucket_size + s)
    return out

  def resident(self) -> dict[int, int]:
    """Every resident id and its row."""
    return {i: b * self.p.bucket_size + s for b, d in enumerate(self.where) for i, s in d.items()}

  def step(self, ids: list[int]) -> tuple[list[int], list[int]]:
    """One training step: returns (rows of ``ids``, rows placed this step)."""
    p = self.p
    self.clock += 1
    t = self.clock
    if p.decays(t):
      if p.eviction == policy_lib.LFU:
        self.score = [[s >> 1 for s in row] for row in self.score]
      self.sketch >>= 1
    counts: dict[int, int] = {}
    for i in ids:
      if i != PAD:
        counts[i] = counts.get(i, 0) + 1
    per_bucket: dict[int, list[int]] = {}
    for i in sorted(counts):
      per_bucket.setdefault(bucket(i, p.num_buckets), []).append(i)
    placed_rows, admitted, evicted = [], 0, 0
    for b, members in per_bucket.items():
      where, key, score = self.where[b], self.key[b], self.score[b]
      touched = set()
      candidates = []
      for i in members:
        s = where.get(i)
        if s is None:
          candidates.append(i)
          continue
        touched.add(s)
        score[s] = t if p.eviction != policy_lib.LFU else min(score[s] + counts[i], INT_MAX)
      if p.uses_sketch:
        for i in candidates:
          for r in range(p.sketch_depth):
            c = cell(i, r, p.width)
            self.sketch[b, r, c] = min(self.sketch[b, r, c] + counts[i], 255)
        candidates = [i for i in candidates
                      if min(self.sketch[b, r, cell(i, r, p.width)]
                             for r in range(p.sketch_depth)) >= p.admit_after]
      for i in candidates:               # ascending ids
        free = [s for s in range(p.bucket_size) if key[s] is None]
        if free:
          s = free[0]
        elif p.eviction is not None:
          victims = [s for s in range(p.bucket_size) if s not in touched]
          if not victims:
            continue
          s = min(victims, key=lambda v: (score[v], v))
          del where[key[s]]
          evicted += 1
        else:
          continue
        key[s] = i
        where[i] = s
        score[s] = t if p.eviction != policy_lib.LFU else counts[i]
        touched.add(s)
        admitted += 1
        placed_rows.append(b * p.bucket_size + s)
    rows = self.lookup(ids)
    valid = [i for i in ids if i != PAD]
    self.stats = {
        "occupancy": sum(len(d) for d in self.where) / p.capacity,
        "admitted": admitted,
        "evicted": evicted,
        "default_share": (sum(1 for i, r in zip(ids, rows) if i != PAD and r < 0)
                          / max(1, len(valid))),
    }
    return rows, placed_rows
