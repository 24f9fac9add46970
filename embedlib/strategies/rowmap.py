"""Logical rows to physical rows and back: padding, and a stack's placement.

A plain table's physical rows are its logical rows followed by padding. A
stack of tables (``plan.placement``) puts runs of logical rows where the
placement says (``placement.segments``): ids are mapped before a lookup,
and the table and row slots are rebuilt in either order when loaded or
saved. Runs are static: the maps are slices and a small ``searchsorted``,
never an index array the size of the table.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def physical_ids(ids, plan):
  """Physical rows of logical ``ids`` (``-1`` stays ``-1``).

  >>> from embedlib.plan import plan_embedding, placement
  >>> p = placement.place([placement.Member("a", 3, 1, "table"),
  ...                      placement.Member("b", 3, 1, "table")], group=2)
  >>> plan = plan_embedding(6, 4, mesh={"batch": 2}, placement=p)
  >>> physical_ids(jnp.array([0, 2, 3, 5, -1]), plan).tolist()
  [0, 2, 3, 5, -1]
  """
  if plan.placement is None:
    return ids
  segments = np.asarray(plan.placement.segments, np.int32).reshape(-1, 3)
  starts = jnp.asarray(segments[:, 0])
  shift = jnp.asarray(segments[:, 2] - segments[:, 0])
  run = jnp.clip(jnp.searchsorted(starts, ids, side="right") - 1, 0, len(segments) - 1)
  return jnp.where(ids >= 0, ids + shift[run], -1).astype(ids.dtype)


def to_physical(x, plan):
  """``x`` of ``[num_embeddings, ...]`` logical rows laid out as ``[padded rows, ...]``.

  Columns past ``x``'s are zero (hidden padding); so are padded rows.
  """
  rows, cols = plan.padded_shape
  col_pad = [(0, 0)] * (x.ndim - 1)
  if x.ndim == 2:
    col_pad = [(0, cols - x.shape[1])]
  if plan.placement is None:
    return jnp.pad(x, [(0, rows - x.shape[0])] + col_pad)
  per_rank = plan.placement.rows_per_rank
  blocks = [[] for _ in range(plan.placement.group)]
  for logical, n, physical in sorted(plan.placement.segments, key=lambda s: s[2]):
    blocks[physical // per_rank].append(x[logical:logical + n])
  parts = []
  for block in blocks:
    used = sum(b.shape[0] for b in block)
    parts.extend(block)
    if used < per_rank:
      parts.append(jnp.zeros((per_rank - used,) + x.shape[1:], x.dtype))
  return jnp.pad(jnp.concatenate(parts), [(0, 0)] + col_pad)


def to_logical(x, plan):
  """The inverse of ``to_physical``: ``[num_embeddings, ...]`` (features columns)."""
  if x.ndim == 2:
    x = x[:, : plan.features]
  if plan.placement is None:
    return x[: plan.num_embeddings]
  return jnp.concatenate([x[p:p + n] for _, n, p in plan.placement.segments])
