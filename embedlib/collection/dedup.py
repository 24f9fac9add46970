"""Id dedup with a static capacity: look each distinct id up once per data shard.

Every data shard sorts its own ids (all features reading one table, bags
concatenated) and keeps at most ``num_unique`` distinct valid ids plus the
inverse index of each id. Only the unique ids enter the table's lookup, so
the token-sharded layouts communicate ``num_unique`` ids and rows per shard
instead of one per id; the batch is rebuilt on the shard that owns it, and
pooled features are pooled there with the ``bag`` kernel reading the unique
rows (no ``[batch, bag, features]`` intermediate).

Overflow (more distinct ids in one shard than ``num_unique``) is never
silently wrong: the collection checks the count and either falls back to the
lookup without dedup (``lax.cond``) or raises, naming the table and the
capacity it needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from embedlib import _compat

_NO_ID = jnp.iinfo(jnp.int32).max  # sorts after every valid id


def unique_with_inverse(ids, capacity: int):
  """Distinct valid ids of ``ids``, their inverse index and their count.

  A sort rather than ``jnp.unique(size=...)``: invalid ids (``-1``) must not
  use up capacity, and the count that detects overflow comes from the same
  sort. The sort has one operand (the ids) and each id finds its place by a
  binary search, as ``optim.apply.dedup`` does: on CPU several times faster
  than sorting the ids with their positions (``argsort``).

  Args:
    ids: int32 of any shape, ``-1`` for padding and invalid ids.
    capacity: static number of unique slots.

  Returns:
    ``(unique [capacity] int32 padded with -1, inverse ids.shape int32 with
    -1 at invalid ids, count [] int32)``. When ``count > capacity``, the
    inverse of the dropped ids is ``>= capacity`` (a caller must not use it).

  >>> u, inv, n = unique_with_inverse(jnp.array([[7, 3, 7], [-1, 3, 9]]), 4)
  >>> u.tolist(), inv.tolist(), int(n)
  ([3, 7, 9, -1], [[1, 0, 1], [-1, 0, 2]], 3)
  """
  flat = ids.reshape(-1).astype(jnp.int32)
  valid = flat >= 0
  keys = jnp.where(valid, flat, _NO_ID)
  key = lax.sort(keys)
  first = (key != _NO_ID) & jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]])
  slot = jnp.cumsum(first, dtype=jnp.int32) - 1
  count = jnp.sum(first, dtype=jnp.int32)
  unique = jnp.full((capacity,), -1, jnp.int32)
  unique = unique.at[jnp.where(first, slot, capacity)].set(key, mode="drop")
  # Each id's first position among the sorted keys holds its slot.
  at = jnp.searchsorted(key, keys, method="scan_unrolled")
  inverse = jnp.where(valid, slot[at], -1)
  return unique, inverse.reshape(ids.shape), count


def pad_batch(x, multiple: int, fill):
  """Pads the leading (batch) dimension up to a multiple of the data shards."""
  pad = -x.shape[0] % multiple
  if not pad:
    return x
  return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)


def restore_batch(x, batch: int, mesh, like):
  """Strips batch padding and splits the batch as ``like`` (the ids) is split.

  The same rule as the lookups without dedup (``strategies.sharded``), so
  both sides of the overflow ``lax.cond`` return the same sharding.
  """
  if mesh is None:
    return x[:batch]
  if x.shape[0] != batch:
    # An uneven batch can't stay split; slicing a split dim is not allowed.
    x = _compat.place(x, mesh, P())[:batch]
  spec = _compat.leading_spec(like, mesh)
  if spec is not None and spec != _compat.leading_spec(x, mesh):
    x = _compat.place(x, mesh, P(spec or None))
  return x


def _map_shards(body, args, *, plan, mesh, check_vma=True):
  """Runs ``body`` on each data shard of ``args`` (all split on dim 0)."""
  if mesh is None:
    return body(*args)
  spec = P(plan.data_axes or None)
  args = jax.tree.map(lambda a: _compat.place(a, mesh, spec), args)
  return _compat.shard_map(
      body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma
  )(*args)


def unique_per_shard(ids, capacity: int, *, plan, mesh):
  """``unique_with_inverse`` on each data shard of padded ``ids``.

  Args:
    ids: int32 ``[batch, width]`` with batch a multiple of the data shards.
    capacity: unique slots per data shard.
    plan: the table's ``EmbeddingPlan`` (for its data axes).
    mesh: the mesh, or None.

  Returns:
    ``(unique [shards * capacity], inverse [batch, width] indexing this
    shard's block, counts [shards])``, all split over the data axes.
  """

  def body(local):
    unique, inverse, count = unique_with_inverse(local, capacity)
    return unique, inverse, count[None]

  return _map_shards(body, (ids,), plan=plan, mesh=mesh)


def rebuild(rows, inverse, coefs, *, plan, mesh, gather, bag, check_vma=True):
  """Each shard's features from its unique rows.

  Args:
    rows: ``[shards * capacity, features]``, split over the data axes.
    inverse: per feature, int32 ``[batch, bag]`` indices into the shard's
      block of ``rows`` (``-1`` for padding).
    coefs: per feature, float ``[batch, bag]`` pooling factors (from
      ``bag_coefficients``), or None for a sequence feature.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh, or None.
    gather: local row kernel.
    bag: local pooled kernel.
    check_vma: shard_map's type check (off for the Pallas interpreter).

  Returns:
    Per feature, ``[batch, features]`` (pooled) or ``[batch, bag, features]``.
  """
  pooled = tuple(c is not None for c in coefs)
  coefs = tuple(c for c in coefs if c is not None)

  def body(local_rows, inverse, coefs):
    coefs = iter(coefs)
    return tuple(
        bag(local_rows, inv, next(coefs), combiner="sum") if p else gather(local_rows, inv)
        for inv, p in zip(inverse, pooled)
    )

  return _map_shards(
      body, (rows, tuple(inverse), coefs), plan=plan, mesh=mesh, check_vma=check_vma
  )
