"""Row gradients summed into every row, then all-reduced: the input distribution of small whole tables.

A replicated or hidden-sharded table is held whole (all its rows) by every
rank, so every rank needs every row's summed gradient. All-gathering the
data ranks' ``(ids, row gradients)`` sends each rank the whole global
batch's gradients: ``(D - 1) * ids`` entries over ``D`` data ranks, which
grows with the device count whatever the table. For a table with fewer
rows than that, each rank instead sums its own gradients into a
``[rows, features + 1]`` buffer (the last column counts the valid ids
that hit the row) and the buffers are all-reduced over the data axes: the
same sums, the same touched rows, in about ``2 * rows`` entries, whatever
the batch or the device count. The update then sees each touched row once.

The local sums are sorted and reduced by a scan and written at distinct
rows (``route.sum_duplicates``), as ``sorted_update`` does: no scatter-add
with colliding indices, which XLA:GPU runs as atomics.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from embedlib.optim import route


def pays(plan, ids_per_device: int, itemsize: int) -> bool:
  """Whether the all-reduce moves fewer bytes than the all-gather, for this table and step.

  Static (shapes only): ``plan.sparse_update`` 's choice. Only for tables
  every rank holds whole (replicated or hidden) whose data ranks hold
  different ids. Fewer bytes also means a smaller buffer: ``rows < data
  shards * ids / 2`` rows against the all-gather's ``data shards * ids``.
  """
  return plan.sparse_update(ids_per_device, itemsize)[0] == "allreduce"


def summed(ids, grads, *, rows: int, axes):
  """Every row's gradient summed over this rank's ids and the data ranks'.

  Inside ``shard_map``.

  Args:
    ids: ``[n]`` int32 rows in ``[0, rows)``, ``-1`` invalid: this rank's ids.
    grads: ``[n, features]``, their row gradients.
    rows: the table's rows (every rank holds them all).
    axes: the data axes the ids are split over.

  Returns:
    ``(ids [rows], sums [rows, features] float32)``: ``ids[r]`` is ``r``
    where some valid id on some rank hit row ``r`` (whatever its gradient:
    LazyAdam still steps a row whose gradients cancel), ``-1`` elsewhere.
    The same on every rank of ``axes``.
  """
  n, features = grads.shape
  unique, sums = route.sum_duplicates(ids, grads.astype(jnp.float32))
  # Distinct indices, past the end where there is no id: no atomics on GPU
  # (a -1 would wrap to the last row).
  at = jnp.where(unique >= 0, unique, rows + jnp.arange(n, dtype=jnp.int32))
  hit = jnp.ones((n, 1), jnp.float32)
  local = jnp.zeros((rows, features + 1), jnp.float32).at[at].set(
      jnp.concatenate([sums, hit], axis=1), mode="drop", unique_indices=True)
  # Hit counts as float32 are exact below 2**24 ranks; one all-reduce for both.
  total = lax.psum(local, axes)
  touched = total[:, features] > 0
  return jnp.where(touched, jnp.arange(rows, dtype=jnp.int32), -1), total[:, :features]
