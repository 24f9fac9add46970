"""The collection's memory check: a device's whole training step within ``device_memory_bytes``.

What a device holds for the collection's step is what
``embedlib.plan.memory`` counts for each table of its own and each stack:
the table's shard (a stack's block of rows), the sparse optimizer's slots,
the step's ids, and the temporaries of the lookups and the sparse update
at their peak (``memory.peak_parts``). The ids and rows each table sees a step come from
its features: a pooled feature looks up ``bag`` ids a sample and returns
one row a sample, a sequence feature a row an id. Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from embedlib.collection.specs import FeatureSpec
from embedlib.plan import memory
from embedlib.plan.report import human_bytes


def lookups(features: Sequence[FeatureSpec], tables, local_batch: int) -> tuple[int, int]:
  """``(ids, rows)``: ids a device looks up in ``tables`` (names) a step, rows it gets back.

  >>> feats = [FeatureSpec("a", "t", max_ids_per_sample=4), FeatureSpec("b", "t", combiner=None,
  ...                                                                     max_ids_per_sample=2)]
  >>> lookups(feats, ["t"], 128)  # pooled: 512 ids, 128 rows; sequence: 256 ids and rows
  (768, 384)
  """
  ids = rows = 0
  for f in features:
    if f.table in tables:
      bag = f.max_ids_per_sample or 1
      ids += local_batch * bag
      rows += local_batch * (bag if f.is_sequence else 1)
  return ids, rows


def step_memory(apart, stacks, features, *, batch_size: int,
                optimizer=memory.DEFAULT_OPTIMIZER) -> memory.DeviceMemory:
  """A device's memory of the collection's training step (``memory.device_memory``).

  Args:
    apart: ``(plan, num_unique)`` of each table with a layout of its own:
      its ``EmbeddingPlan`` (named as the table) and dedup capacity.
    stacks: the ``StackPlan`` s.
    features: the ``FeatureSpec`` s.
    batch_size: samples per step over the whole mesh.
    optimizer: the sparse optimizer (``memory.slot_layout``).

  Returns:
    A ``memory.DeviceMemory``, a ``TableMemory`` per table apart and per stack.
  """
  items = []
  for plan, num_unique in apart:
    ids, rows = lookups(features, [plan.name], math.ceil(batch_size / plan.data_shards))
    items.append((plan, ids, num_unique, rows))
  for s in stacks:
    ids, rows = lookups(features, s.members, math.ceil(batch_size / s.plan.data_shards))
    items.append((s.plan, ids, s.num_unique, rows))
  return memory.device_memory(items, optimizer)


def check_memory(step: memory.DeviceMemory, stacks, budget: int | None) -> None:
  """Raises when a device can't hold ``step`` (``step_memory``) within ``budget`` bytes.

  The message lists what was counted (tables, slots, ids, temporaries) and
  the fix: the largest table or stack block to spread, the batch the
  temporaries grow with, or a larger budget.
  """
  if budget is None or step.total <= budget:
    return
  words = {"lookup": "a lookup's exchange buffers", "returned": "the rows returned",
           "update": "the sparse update's buffers", "kept": "the row gradients kept for it",
           "dedup": "dedup", "small": "small buffers"}
  parts = memory.peak_parts(dict(t.temporaries) for t in step.tables)
  temporaries = ", ".join(f"{words[k]} {human_bytes(v)}" for k, v in parts.items() if v)
  largest = max(step.tables, key=lambda t: t.table + t.slots)
  stack = next((s for s in stacks if s.name == largest.name), None)
  if stack is not None:
    member = _largest_member(stack)
    spread = (f"stack {stack.name!r} holds the most ({human_bytes(largest.table)} of rows a "
              f"device), table {member!r} the largest part: shard {member!r} by rows "
              f"(sharding='routed') or pin it elsewhere (device=)")
  else:
    spread = (f"table {largest.name!r} holds the most ({human_bytes(largest.table)} a device): "
              f"shard it over more devices")
  raise ValueError(
      f"the embedding's training step doesn't fit device memory: a device needs "
      f"{human_bytes(step.total)}, more than device_memory_bytes={budget} "
      f"({human_bytes(budget)}): tables {human_bytes(step.table)}, {step.optimizer} slots "
      f"{human_bytes(step.slots)}, ids {human_bytes(step.ids)}, temporaries "
      f"{human_bytes(step.temporary)} ({temporaries}). {spread}; or take a smaller "
      f"batch_size (the ids and temporaries grow with it), an optimizer with fewer slots, "
      f"or raise device_memory_bytes.")


def _largest_member(stack) -> str:
  """The member of ``stack`` holding the most rows on one device."""
  p = stack.plan.placement
  held = [(max(n * share for share in p.shares(m)), m) for m, n in p.members]
  return max(held)[1]
