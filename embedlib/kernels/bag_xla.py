"""The ``kernel="xla"`` pooled bag: one row gather per bag slot, summed as it goes.

`xla.bag_segment_sum` gathers every id into ``[batch * bag, features]``
and segment-sums it. Here each slot ``l`` of the bag is gathered, scaled by its
coefficient and added to a ``[batch, features]`` accumulator; XLA fuses the
slots' gathers and adds into one loop, so the ``[batch * bag, features]``
rows are never written and read back as there
(``benchmarks/collection_lookup.py`` times the two on CPU). The same f32
terms are summed in the same order (slot by slot): its result,
up to where XLA contracts a multiply and an add into one fused
multiply-add (an ulp).

Its gradient is written by hand (``jax.custom_vjp``): autodiff of the
unrolled slots would scatter into the table once per slot; the backward here
scatters once, like `xla.bag_segment_sum`'s. Bags wider than
``MAX_UNROLLED_SLOTS`` take `xla.bag_segment_sum`, to keep the unrolled HLO
small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedlib import invalid_ids
from embedlib.kernels import bags
from embedlib.kernels import xla
from embedlib.sharding import sum_to_varying_of

#: Widest bag that is unrolled slot by slot; wider bags use `xla.bag_segment_sum`.
MAX_UNROLLED_SLOTS = 64


def out_of_range(ids, num_embeddings):
  """Invalid ids moved to ``num_embeddings``: read as zeros, dropped by scatters."""
  valid = invalid_ids.valid_mask(ids, num_embeddings)
  return jnp.where(valid, ids, num_embeddings)


@jax.custom_vjp
def _pooled(table, ids, coef):
  """``sum_l coef[:, l] * table[ids[:, l]]`` in float32; ids already in range or past it."""
  out = None
  for slot in range(ids.shape[1]):
    rows = jnp.take(table, ids[:, slot], axis=0, mode="fill", fill_value=0)
    term = rows.astype(jnp.float32) * coef[:, slot, None]
    out = term if out is None else out + term
  return out


def _pooled_fwd(table, ids, coef):
  return _pooled(table, ids, coef), (table, ids, coef)


def pooled_bwd(res, g):
  table, ids, coef = res
  batch, bag = ids.shape
  features = table.shape[1]
  # One row gradient per id, scattered once; ids past the table are dropped.
  row_grads = (g[:, None, :] * coef[:, :, None]).reshape(batch * bag, features)
  table_grad = jnp.zeros(table.shape, table.dtype).at[ids.reshape(-1)].add(
      row_grads.astype(table.dtype), mode="drop"
  )
  # d/dcoef[b, l] = <g[b], row[b, l]>; removed by XLA when nothing needs it
  # (the weights' gradient is its only use).
  rows = jnp.take(table, ids, axis=0, mode="fill", fill_value=0)
  coef_grad = jnp.einsum("blf,bf->bl", rows.astype(jnp.float32), g)
  # Inside shard_map each cotangent is summed over the axes it varies over
  # and its primal does not (the transpose of the implicit broadcast).
  return (
      sum_to_varying_of(table_grad, table),
      None,
      sum_to_varying_of(coef_grad, coef),
  )


_pooled.defvjp(_pooled_fwd, pooled_bwd)


def bag_xla(
    table: jax.Array,
    ids: jax.Array,
    weights: jax.Array | None = None,
    *,
    combiner: str = "sum",
) -> jax.Array:
  """`xla.bag_segment_sum`'s result, computed slot by slot (see the module docstring).

  Same arguments, result and gradients as `xla.bag_segment_sum`.

  >>> import jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> bag_xla(table, jnp.array([[0, 2, -1], [-1, -1, -1]]), combiner="mean").tolist()
  [[2.0, 3.0], [0.0, 0.0]]
  """
  bag = ids.shape[1]
  if bag == 0 or bag > MAX_UNROLLED_SLOTS:
    return xla.bag_segment_sum(table, ids, weights, combiner=combiner)
  coef = bags.bag_coefficients(ids, weights, table.shape[0], combiner)
  pooled = _pooled(table, out_of_range(ids, table.shape[0]), coef)
  return pooled.astype(table.dtype)
