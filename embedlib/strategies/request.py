"""``Request``: one lookup of a table, the unit every lookup path takes.

Every table kind (``ShardedEmbed``, ``QuantizedEmbed``, ``DynamicEmbed``)
takes its lookups as ``Request`` s through one method, ``lookup_requests``,
which checks each with ``Request.check_bag``: the one place a bag's shape is
checked.
"""

from __future__ import annotations

import typing as tp

import numpy as np
from flax import struct

from embedlib import kernels


@struct.dataclass
class Request:
  """One feature's ids for one table, and how their rows are combined.

  A pytree (ids and weights are leaves; ``combiner`` is static), so
  requests pass through ``jit`` like arrays.

  >>> import numpy as np
  >>> Request(np.array([[3, -1]]), combiner="mean").check_bag("items", (1, 2))
  >>> Request(np.array([3, 4]), combiner="mean").check_bag("items", (2,))
  Traceback (most recent call last):
  ...
  ValueError: items: bag() takes ids [batch, bag] padded with -1, got shape (2,); use __call__ for unpooled rows.

  Attributes:
    ids: the ids the table reads, ``[batch, ...]``; ``[batch, bag]`` when
      pooled, padded with ``-1``. A ``ShardedEmbed`` takes integers of any
      dtype and makes them int32, ``-1`` for padding and invalid ids (see
      ``embedlib.invalid_ids.sanitize``); a ``DynamicEmbed`` takes raw ids
      (see ``DynamicEmbed.words``).
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

  def check_bag(self, owner: str, shape: tuple) -> None:
    """Raises unless a pooled request's ids are ``[batch, bag]`` and its weights theirs.

    Args:
      owner: what the message names first (a table, a feature).
      shape: the ids' shape (a ``DynamicEmbed``'s ``Words`` hold a word pair
        per id: theirs, not their array's).
    """
    if not self.pooled:
      return
    kernels.check_combiner(self.combiner)
    shape = tuple(shape)
    if len(shape) != 2:
      raise ValueError(
          f"{owner}: bag() takes ids [batch, bag] padded with -1, got shape {shape}; use "
          "__call__ for unpooled rows.")
    if self.weights is not None and tuple(np.shape(self.weights)) != shape:
      raise ValueError(
          f"{owner}: weights shape {tuple(np.shape(self.weights))} must equal the ids shape "
          f"{shape}.")
