"""Logical rows to physical rows and back: padding, and a stack's placement.

A plain table's physical rows are its logical rows followed by padding. A
stack of tables (``plan.placement``) puts runs of logical rows where the
placement says (``placement.segments``): ids are mapped before a lookup,
and the table and row slots are rebuilt in either order when loaded or
saved. The runs are static and few: each row finds its run with a
``searchsorted`` over them, and no index table is stored in the program.
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

  Columns past ``x``'s are zero (hidden padding); so are padded rows. A
  stack's rows are gathered by physical row (each finds its run with a
  ``searchsorted``), which compiles and partitions as one gather however
  many runs the placement has.
  """
  rows, cols = plan.padded_shape
  col_pad = [(0, cols - x.shape[1])] if x.ndim == 2 else []
  if plan.placement is None:
    return jnp.pad(x, [(0, rows - x.shape[0])] + col_pad)
  runs = np.asarray(sorted(plan.placement.segments, key=lambda s: s[2]), np.int32)
  logical, length, physical = (jnp.asarray(runs[:, i]) for i in range(3))
  p = jnp.arange(rows, dtype=jnp.int32)
  run = jnp.clip(jnp.searchsorted(physical, p, side="right") - 1, 0, len(runs) - 1)
  offset = p - physical[run]
  source = jnp.where(offset < length[run], logical[run] + offset, x.shape[0])
  out = x.at[source].get(mode="fill", fill_value=0)
  return jnp.pad(out, [(0, 0)] + col_pad) if col_pad else out


def to_logical(x, plan):
  """The inverse of ``to_physical``: ``[num_embeddings, ...]`` (features columns)."""
  if x.ndim == 2:
    x = x[:, : plan.features]
  if plan.placement is None:
    return x[: plan.num_embeddings]
  return jnp.take(x, physical_ids(jnp.arange(plan.num_embeddings, dtype=jnp.int32), plan),
                  axis=0)
