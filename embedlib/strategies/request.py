"""``Request``: one lookup of a table, the unit every lookup path takes."""

from __future__ import annotations

import typing as tp

from flax import struct


@struct.dataclass
class Request:
  """One feature's ids for one table, and how their rows are combined.

  A pytree (ids and weights are leaves; ``combiner`` is static), so
  requests pass through ``jit`` like arrays.

  Attributes:
    ids: int32 ``[batch, ...]``, ``-1`` for padding and invalid ids (see
      ``embedlib.invalid_ids.sanitize``); ``[batch, bag]`` when pooled.
    weights: float ``[batch, bag]`` per-id weights of a pooled request, or
      None for all ones.
    combiner: ``"sum" | "mean" | "sqrtn"`` pools the bag axis into
      ``[batch, features]``; None returns the rows unpooled,
      ``ids.shape + (features,)``.
    member: for a stack of tables, the member table the ids read (their
      rows are already the stack's), which sizes the route; else None.
  """

  ids: tp.Any
  weights: tp.Any = None
  combiner: str | None = struct.field(pytree_node=False, default=None)
  member: str | None = struct.field(pytree_node=False, default=None)

  @property
  def pooled(self) -> bool:
    return self.combiner is not None
