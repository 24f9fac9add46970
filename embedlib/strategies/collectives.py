"""The three distribution steps every sharded strategy is built from.

Inside ``shard_map`` a table group splits into *token axes* (ranks holding
different ids: the data axes overlap the table axes, the recommender seed's
layout) and *rest axes* (ranks holding the same ids: tensor-parallel). With no
token axes these reduce to the plain tensor-parallel collectives: ``psum``
and a tiled ``all_gather``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from embedlib import sharding as sharding_lib


def gather_tokens(x: jax.Array, token_axes: tuple[str, ...]) -> jax.Array:
  """Input distribution: every rank of the group sees the group's tokens.

  Args:
    x: ``[tokens, ...]`` local to this rank.
    token_axes: mesh axes whose ranks hold different tokens.

  Returns:
    ``[tokens * |token_axes|, ...]``, ordered by rank along ``token_axes``.
  """
  if not token_axes:
    return x
  return lax.all_gather(x, token_axes, axis=0, tiled=True)


def sum_partials(x, token_axes, rest_axes):
  """Output distribution for partial results (each rank holds a summand).

  Sums over the group, then hands each token rank its own tokens back.

  Args:
    x: ``[group_tokens, ...]`` partial values.
    token_axes: as in ``gather_tokens``.
    rest_axes: table axes whose ranks hold the same tokens.

  Returns:
    ``[group_tokens / |token_axes|, ...]``: full sums of this rank's tokens.
  """
  if rest_axes:
    x = lax.psum(x, rest_axes)
  if token_axes:
    x = lax.psum_scatter(x, token_axes, scatter_dimension=0, tiled=True)
  return x


def concat_slices(x, token_axes, rest_axes):
  """Output distribution for column slices (each rank holds some columns).

  The table's column blocks are laid out token axes first (see
  ``plan_embedding``), so gathering over the rest axes and then trading
  token blocks for column blocks with ``all_to_all`` rebuilds the columns in
  order.

  Args:
    x: ``[group_tokens, cols_per_rank]``.
    token_axes: as in ``gather_tokens``.
    rest_axes: as in ``sum_partials``.

  Returns:
    ``[group_tokens / |token_axes|, cols_per_rank * group]``.
  """
  last = x.ndim - 1
  if rest_axes:
    x = gather_rest(x, rest_axes, last)
  if token_axes:
    x = lax.all_to_all(x, token_axes, 0, last, tiled=True)
  return x


def gather_rest(x, rest_axes, axis):
  """Tiled all-gather over ranks holding the same tokens, with a right VJP.

  With shard_map's type check on, ``to="invarying"`` tells it the result is
  the same on every rest rank, and the transpose is a slice. With the check
  off (the Pallas interpreter needs that) all_gather's transpose would sum
  the rank copies of the cotangent; a psum of zero-padded slices gives the
  same result and transposes correctly without the types.
  """
  if set(rest_axes) <= sharding_lib.varying_axes(x):
    return lax.all_gather(x, rest_axes, axis=axis, tiled=True, to="invarying")
  ranks = lax.psum(1, rest_axes)
  width = x.shape[axis]
  full = jnp.zeros(x.shape[:axis] + (width * ranks,) + x.shape[axis + 1:], x.dtype)
  start = lax.axis_index(rest_axes) * width
  return lax.psum(lax.dynamic_update_slice_in_dim(full, x, start, axis), rest_axes)


def rest_share(flat, rest_axes):
  """This rank's share of ids that every rank along ``rest_axes`` holds.

  Ranks holding the same ids (tensor-parallel) each take one slice of them
  (the last padded with ``-1``); ``gather_rest`` brings their results
  back together.
  """
  if not rest_axes:
    return flat
  ranks = lax.psum(1, rest_axes)
  flat = sharding_lib.pad_tokens(flat, ranks, -1)
  size = flat.shape[0] // ranks
  return lax.dynamic_slice_in_dim(flat, lax.axis_index(rest_axes) * size, size)


def group_rank(table_axes: tuple[str, ...]):
  """This rank's position in the table group (row-major over ``table_axes``).

  0 without table axes, so a strategy also runs outside ``shard_map`` (one
  device, no mesh).
  """
  if not table_axes:
    return 0
  return lax.axis_index(table_axes)
