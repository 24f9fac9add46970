"""The unsharded reference collection: plain ``jnp.take`` and sums, no embedlib code.

It is the specification the sharded collection is tested against: a feature's
output depends only on the logical tables, its ids and weights, and the
combiner's TensorFlow semantics (invalid ids are padding; mean divides by the
bag's total weight, sqrtn by the root of its squared weights; zero
denominators give zeros).
"""

import jax.numpy as jnp
import numpy as np


def ragged_to_dense(values, lengths, width, weights=None):
  """Numpy loop, independent of ``kernels.ragged_to_padded``."""
  values, lengths = np.asarray(values), np.asarray(lengths)
  ids = np.full((len(lengths), width), -1, np.int64)
  w = np.zeros((len(lengths), width), np.float32)
  start = 0
  for b, n in enumerate(lengths):
    ids[b, :n] = values[start:start + n]
    if weights is not None:
      w[b, :n] = np.asarray(weights)[start:start + n]
    start += n
  return ids, (None if weights is None else w)


def feature(table, ids, weights, combiner):
  """One feature's output from its logical ``table`` and ids ``[batch]`` or ``[batch, bag]``."""
  single = ids.ndim == 1
  ids = ids[:, None] if single else ids
  if weights is not None and weights.ndim == 1:
    weights = weights[:, None]
  valid = (ids >= 0) & (ids < table.shape[0])
  rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0) * valid[..., None]
  if combiner is None:
    return rows[:, 0] if single else rows
  w = jnp.ones(ids.shape) if weights is None else jnp.asarray(weights)
  w = jnp.where(valid, w, 0.0)
  pooled = jnp.sum(w[..., None] * rows, axis=1)
  if combiner == "sum":
    return pooled
  denom = jnp.sum(w, axis=1) if combiner == "mean" else jnp.sqrt(jnp.sum(w * w, axis=1))
  safe = jnp.where(denom > 0, denom, 1.0)
  return jnp.where(denom[:, None] > 0, pooled / safe[:, None], 0.0)


def collection(tables, features, inputs, weights):
  """``{feature: output}`` for logical ``tables`` ``{name: [rows, cols]}``."""
  out = {}
  for f in features:
    x, w = inputs[f.name], weights.get(f.name)
    if isinstance(x, tuple):
      x, w = ragged_to_dense(*x, f.max_ids_per_sample, w)
    out[f.name] = feature(tables[f.table], jnp.asarray(x), w, f.combiner)
  return out
