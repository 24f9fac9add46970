"""The admission and eviction policy of a dynamic table, and its validation.

A dynamic table has ``capacity`` rows in ``num_buckets = capacity /
bucket_size`` buckets of ``bucket_size`` slots (bucket ``b`` holds rows
``[b * bucket_size, (b + 1) * bucket_size)``). A hash of the raw id picks
its bucket (``ids.bucket_of``); the number of buckets never depends on the
devices, so neither does any id's row.

One training step (clock ``t``, counted from 1) does, in each bucket, with
the step's distinct ids and ``n(id)``, how many times each occurs:

1. Decay: when ``decay_every > 0`` and ``t % decay_every == 0``, every LFU
   score and every sketch counter is halved (``>> 1``).
2. Residents among the step's ids are touched: LRU sets their score to
   ``t``, LFU adds ``n(id)`` (saturating at ``2**31 - 1``).
3. Admission: the other ids are candidates. With ``admit_after == 1`` all
   are admitted; otherwise each adds ``n(id)`` to its cell in each of the
   bucket's ``sketch_depth`` count-min rows (uint8 counters, saturating at
   255), all the step's additions first, and a candidate is admitted when
   its estimate (the minimum over its cells) reaches ``admit_after``.
4. Placement, in ascending order of the admitted ids (as unsigned 64-bit
   values), so the result never depends on the order ids arrive in: an id
   takes the bucket's lowest free slot; with none free and eviction on, it
   evicts the resident of minimum score that was neither touched nor
   placed this step (ties: the lowest slot); with none, it stays out. A
   placed id's score is ``t`` (LRU) or ``n(id)`` (LFU), and its row (and
   its optimizer slots) start again from the table's initialisation.

Ids that are not resident after the step read the default row. In
``eval()`` mode nothing above happens: ids are only looked up.

The count-min sketch never undercounts; with ``N`` additions to a bucket
since the last decay it overcounts one id by more than ``e * N /
sketch_width`` with probability at most ``exp(-sketch_depth)``
(Cormode and Muthukrishnan), so a rare id may be admitted early, never
late.
"""

from __future__ import annotations

import dataclasses

LRU = "lru"
LFU = "lfu"
EVICTIONS = (LRU, LFU, None)
MAX_ADMIT = 255
EMPTY = -1


@dataclasses.dataclass(frozen=True)
class Policy:
  """Sizes and rules of one dynamic table (hashable: a static jit argument)."""

  capacity: int
  bucket_size: int = 128
  admit_after: int = 1
  eviction: str | None = LRU
  decay_every: int = 0
  sketch_depth: int = 2
  sketch_width: int | None = None
  # A label for messages, not a rule: tables that differ only by name share
  # their compiled map steps (``mapping.run`` takes the policy as a static argument).
  name: str = dataclasses.field(default="dynamic", compare=False)

  def __post_init__(self):
    name = self.name
    for field in ("capacity", "bucket_size", "admit_after", "decay_every", "sketch_depth"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: {field}={value!r} must be an int.")
    if self.bucket_size < 1:
      raise ValueError(f"{name}: bucket_size={self.bucket_size} must be at least 1.")
    if self.capacity < self.bucket_size or self.capacity % self.bucket_size:
      raise ValueError(
          f"{name}: capacity={self.capacity} must be a positive multiple of "
          f"bucket_size={self.bucket_size} (whole buckets); use capacity="
          f"{max(1, -(-self.capacity // self.bucket_size)) * self.bucket_size} or "
          "another bucket_size.")
    if not 1 <= self.admit_after <= MAX_ADMIT:
      raise ValueError(
          f"{name}: admit_after={self.admit_after} must be in [1, {MAX_ADMIT}] (1 "
          "admits an id on first sight; the sketch counts up to 255).")
    if self.eviction not in EVICTIONS:
      raise ValueError(
          f"{name}: eviction={self.eviction!r} is not a policy; use 'lru', 'lfu' or "
          "None (a full bucket then gives newcomers the default row).")
    if self.decay_every < 0:
      raise ValueError(f"{name}: decay_every={self.decay_every} must be >= 0 (0: never).")
    if self.sketch_depth < 1 or (self.sketch_width is not None and self.sketch_width < 1):
      raise ValueError(f"{name}: the sketch needs depth and width >= 1.")

  @property
  def num_buckets(self) -> int:
    return self.capacity // self.bucket_size

  @property
  def width(self) -> int:
    return self.sketch_width or self.bucket_size

  @property
  def uses_sketch(self) -> bool:
    return self.admit_after > 1

  def decays(self, clock: int) -> bool:
    return self.decay_every > 0 and clock % self.decay_every == 0

  def map_bytes_per_row(self) -> float:
    """Bytes of map state per row: two key words, a score, the placement clock
    (for ``reset_slots``) and the sketch's share (uint8 counters).

    >>> Policy(1024).map_bytes_per_row(), Policy(1024, admit_after=2).map_bytes_per_row()
    (16.0, 18.0)
    """
    sketch = self.sketch_depth * self.width / self.bucket_size if self.uses_sketch else 0
    return 16.0 + sketch
