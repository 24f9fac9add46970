"""``DynamicSpec``: the settings that make a table dynamic, checked in one place.

A ``DynamicEmbed`` takes one (``dynamic=``), and so does a collection's
``TableSpec``; both check it here, with the table's name in every message.
Its bucket size, left unset, is the largest that splits the table into
whole buckets on every device of its group, at most
``DEFAULT_BUCKET_SIZE`` (``fitting_bucket_size``): a small table in a
tutorial or a test just works.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from embedlib.dynamic import ids as ids_lib
from embedlib.dynamic import policy as policy_lib

#: What an id that is not resident reads: zeros, or one learned row.
ZERO = "zero"
LEARNED = "learned"
DEFAULTS = (ZERO, LEARNED)
#: The bucket size of a table whose rows split into buckets of it on every device.
DEFAULT_BUCKET_SIZE = 128
#: A fitting bucket smaller than this, in a table larger than one, is refused.
SMALLEST_FITTING_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class DynamicSpec:
  """Makes a table dynamic (``embedlib.DynamicEmbed``): raw ids, rows given on admission.

  The table's ``num_embeddings`` is then its capacity: rows given to ids on
  admission and taken back on eviction (the rules: ``embedlib.dynamic.policy``).

  >>> DynamicSpec(admit_after=2).policy(256, name="user").eviction
  'lru'
  >>> DynamicSpec().policy(64, name="user").bucket_size   # the default fits small tables
  64
  >>> DynamicSpec(bucket_size=64).policy(100, name="table 'user'")
  Traceback (most recent call last):
  ...
  ValueError: table 'user': capacity=100 must be a positive multiple of bucket_size=64 (whole buckets); use capacity=128 or another bucket_size.

  Attributes:
    admit_after: occurrences before an id gets a row (1: on first sight).
    eviction: ``"lru"``, ``"lfu"`` or None (a full bucket turns newcomers away).
    bucket_size: slots per bucket; None: ``fitting_bucket_size``.
    decay_every: steps between halvings of LFU scores and sketch counters
      (0: never).
    sketch_depth, sketch_width: the admission count-min sketch per bucket
      (width default ``bucket_size``).
    default: ``"zero"`` or ``"learned"``, what an id without a row reads.
    id_dtype: the raw ids' declared dtype (``int32``, ``uint32``, ``int64``,
      ``uint64``); host ids outside it are an error. None: any 64-bit
      pattern (signed ids are their two's complement).
    route_capacity: for a collection's dynamic table, ids one rank sends
      each owner of the map per step (a lone ``DynamicEmbed`` takes
      ``Layout(route_capacity=)``); None: the collection's.
  """

  admit_after: int = 1
  eviction: str | None = policy_lib.LRU
  bucket_size: int | None = None
  decay_every: int = 0
  sketch_depth: int = 2
  sketch_width: int | None = None
  default: str = ZERO
  id_dtype: str | None = None
  route_capacity: int | None = None

  def policy(self, capacity: int, *, group: int = 1, name: str) -> policy_lib.Policy:
    """The ``Policy`` of a table of ``capacity`` rows split over ``group`` devices.

    Checks every setting; ``name`` (a table's) starts each message.
    """
    if self.default not in DEFAULTS:
      raise ValueError(f"{name}: default={self.default!r}; use one of {DEFAULTS}.")
    if self.id_dtype is not None and str(np.dtype(self.id_dtype)) not in ids_lib.ID_DTYPES:
      raise ValueError(f"{name}: id_dtype={self.id_dtype!r}; use one of "
                       f"{ids_lib.ID_DTYPES} or None.")
    if self.route_capacity is not None and (
        isinstance(self.route_capacity, bool) or not isinstance(self.route_capacity, int)
        or self.route_capacity < 1):
      raise ValueError(f"{name}: route_capacity={self.route_capacity!r} must be an int >= 1.")
    bucket_size = self.bucket_size
    if bucket_size is None:
      bucket_size = fitting_bucket_size(capacity, group, name)
    return policy_lib.Policy(
        capacity, bucket_size=bucket_size, admit_after=self.admit_after,
        eviction=self.eviction, decay_every=self.decay_every,
        sketch_depth=self.sketch_depth, sketch_width=self.sketch_width, name=name)


def fitting_bucket_size(capacity: int, group: int, name: str) -> int:
  """The largest bucket size up to ``DEFAULT_BUCKET_SIZE`` that splits each device's rows.

  ``DEFAULT_BUCKET_SIZE`` when ``capacity`` is a multiple of it times
  ``group``; else the largest divisor of the rows a device owns, which
  for a table smaller than ``DEFAULT_BUCKET_SIZE`` is one bucket a device.

  >>> fitting_bucket_size(1 << 18, 8, "t"), fitting_bucket_size(64, 1, "t")
  (128, 64)
  >>> fitting_bucket_size(1000, 4, "t")   # 250 rows a device
  125
  """
  if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
    raise ValueError(f"{name}: capacity={capacity!r} must be an int >= 1.")
  per_device = capacity // group if capacity % group == 0 else capacity
  if per_device % DEFAULT_BUCKET_SIZE == 0:
    return DEFAULT_BUCKET_SIZE
  largest = max(b for b in range(1, min(DEFAULT_BUCKET_SIZE, per_device) + 1)
                if per_device % b == 0)
  if largest < min(SMALLEST_FITTING_BUCKET, per_device):
    raise ValueError(
        f"{name}: capacity={capacity} over {group} device(s) splits only into buckets of "
        f"{largest} rows; use a capacity that is a multiple of "
        f"{DEFAULT_BUCKET_SIZE * group}, or pass DynamicSpec(bucket_size=...).")
  return largest
