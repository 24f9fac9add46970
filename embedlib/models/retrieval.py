"""Retrieval pieces: in-batch softmax with log-Q correction, a streaming frequency
estimate, and exact top-k over a corpus sharded over the mesh.

In-batch negatives: every request's engaged item is a negative for every
other request of the global batch (the candidates are gathered over the
data axes; each device scores its own requests against all of them). A
popular item is a negative far more often than a rare one, which biases
the learned scores against it; subtracting ``log q`` (the item's sampling
probability) from its logits corrects that (Yi et al., "Sampling-bias-
corrected neural modeling for large corpus item recommendations", RecSys
2019). ``q`` is counted in the batch, or estimated over the stream by
``StreamingFrequency`` (the paper's Algorithm 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import _compat
from embedlib import sharding as sharding_lib

#: What a masked logit is set to (finite: a row of them stays NaN-free).
_MASKED = -1e9


def batch_log_q(item_ids: jax.Array) -> jax.Array:
  """``log(count of each item in the batch / batch size)``, ``[B]``.

  >>> batch_log_q(jnp.array([3, 3, 5, 7])).round(3).tolist()
  [-0.693, -0.693, -1.386, -1.386]
  """
  counts = (item_ids[:, None] == item_ids[None, :]).sum(axis=1)
  return jnp.log(counts / item_ids.shape[0])


def in_batch_softmax_loss(users: jax.Array, items: jax.Array, item_ids: jax.Array, *,
                          temperature: jax.Array, log_q: jax.Array | None = None,
                          remove_accidental_hits: bool = True, mesh=None,
                          weights: jax.Array | None = None) -> jax.Array:
  """Mean softmax cross-entropy of each request's item against the batch's items.

  ``logits[i, j] = <users[i], items[j]> / temperature - log_q[j]``; the
  label of row ``i`` is column ``i``. With ``remove_accidental_hits``, a
  column ``j != i`` holding the same item as ``i`` is masked out of row
  ``i``: the request engaged with it, so it is no negative.

  >>> u = jnp.eye(3)
  >>> loss = in_batch_softmax_loss(u, u, jnp.array([0, 1, 1]), temperature=jnp.float32(0.1))
  >>> round(float(loss), 4)   # rows 1 and 2 don't count each other's item as a negative
  0.0001

  Args:
    users: ``[B, D]`` user embeddings (L2-normalised).
    items: ``[B, D]`` embeddings of each request's engaged item.
    item_ids: ``[B]`` their ids.
    temperature: scalar.
    log_q: ``[B]`` log sampling probability of each item, or None.
    remove_accidental_hits: mask other requests' copies of the same item.
    mesh: the mesh the batch is split over; the items are gathered to every
      device (each scores its requests against the whole batch).
    weights: ``[B]`` each row's weight in the mean (0: the row's item is a
      negative of the others but not a positive of its own), or None.

  Returns:
    The scalar loss.
  """
  if mesh is not None:
    items = sharding_lib.place_always(items, NamedSharding(mesh, P()))
  logits = users @ items.T / temperature
  if log_q is not None:
    logits = logits - log_q[None, :]
  if remove_accidental_hits:
    same = item_ids[:, None] == item_ids[None, :]
    logits = jnp.where(same & ~jnp.eye(same.shape[0], dtype=bool), _MASKED, logits)
  losses = jax.nn.logsumexp(logits, axis=1) - jnp.diagonal(logits)
  if weights is None:
    return jnp.mean(losses)
  return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


class FrequencyState(nnx.Variable):
  """State of ``StreamingFrequency``: saved in checkpoints, never trained."""


class StreamingFrequency(nnx.Module):
  """Streaming estimate of how often each item is sampled (Yi et al. 2019, Algorithm 2).

  Items are hashed into ``num_buckets``; per bucket, ``last`` is the step it
  was last seen and ``gap`` an exponential average (rate ``alpha``) of the
  steps between sightings. An item's frequency per step is ``1 / gap``.
  An item seen ``c`` times in one batch counts as ``c`` arrivals in that
  step (the gap since its last step, divided by ``c``): without this, every
  item of a batch would look at most once a step, and popular items, which
  repeat within a batch, would be under-corrected.

  >>> from flax import nnx
  >>> f = StreamingFrequency(64, alpha=0.5)
  >>> for _ in range(8):
  ...   log_q = f.update(jnp.array([1, 1, 2]))
  >>> bool(log_q[0] > log_q[2]), int(f.step[...])   # item 1 arrives twice as often
  (True, 8)

  Args:
    num_buckets: size of the hashed arrays.
    alpha: learning rate of the gap average.
    initial_gap: the gap assumed before an item is first seen.
  """

  def __init__(self, num_buckets: int, *, alpha: float = 0.01, initial_gap: float = 100.0):
    if num_buckets < 1:
      raise ValueError(f"config.task.frequency_buckets must be >= 1, got {num_buckets}.")
    if not 0.0 < alpha <= 1.0:
      raise ValueError(f"config.task.frequency_alpha={alpha} must lie in (0, 1].")
    self.num_buckets, self.alpha = num_buckets, float(alpha)
    self.last = FrequencyState(jnp.zeros((num_buckets,), jnp.float32))
    self.gap = FrequencyState(jnp.full((num_buckets,), initial_gap, jnp.float32))
    self.step = FrequencyState(jnp.zeros((), jnp.float32))

  def bucket(self, ids: jax.Array) -> jax.Array:
    """Multiplicative hashing in uint32 (wraps the same on every device)."""
    h = ids.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)
    return (h % jnp.uint32(self.num_buckets)).astype(jnp.int32)

  def update(self, ids: jax.Array) -> jax.Array:
    """Records one step's items ``[B]``; returns their ``log q`` (``-log gap``), ``[B]``."""
    t = self.step[...] + 1.0
    h = self.bucket(ids)
    count = (h[:, None] == h[None, :]).sum(axis=1).astype(jnp.float32)
    gap = ((1.0 - self.alpha) * self.gap[...][h]
           + self.alpha * (t - self.last[...][h]) / count)
    # Repeated ids write the same value: each is computed from the old state.
    _compat.assign(self.gap, self.gap[...].at[h].set(gap))
    _compat.assign(self.last, self.last[...].at[h].set(t))
    _compat.assign(self.step, t)
    return -jnp.log(gap)


def sharded_top_k(queries: jax.Array, corpus: jax.Array, k: int, *, mesh, axes,
                  num_valid: int) -> tuple[jax.Array, jax.Array]:
  """Exact top ``k`` corpus rows by dot product, per shard then merged.

  Each device scores every query against its block of the corpus (rows
  split over ``axes``) and keeps its best ``k``; the blocks' ``k`` bests are
  gathered and the best ``k`` of those kept. Rows at or past ``num_valid``
  (padding to a multiple of the shard count) are never returned.

  >>> import jax
  >>> mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  >>> corpus = jnp.eye(8)[jnp.array([3, 1, 4, 0, 6, 2, 7, 5])]  # row r: axis perm[r]
  >>> scores, rows = sharded_top_k(jnp.eye(8)[:2] + 0.1 * jnp.eye(8)[1:3], corpus, 2,
  ...                              mesh=mesh, axes=("data",), num_valid=8)
  >>> rows.tolist()
  [[3, 1], [1, 5]]

  Args:
    queries: ``[Q, D]``.
    corpus: ``[N, D]``, ``N`` a multiple of the shards of ``axes``.
    k: how many; at most ``N / shards``.
    mesh: the mesh.
    axes: mesh axes the corpus rows are split over.
    num_valid: the real rows ``[0, num_valid)``.

  Returns:
    ``(scores [Q, k], rows [Q, k])``, best first, replicated.
  """
  axes = tuple(axes)
  shards = int(np.prod([mesh.shape[a] for a in axes]))
  n = corpus.shape[0]
  if n % shards:
    raise ValueError(f"the corpus has {n} rows, not a multiple of the {shards} shards of "
                     f"{axes}; pad it.")
  per_shard = n // shards
  if k > per_shard:
    raise ValueError(f"k={k} exceeds the {per_shard} corpus rows of each shard; use a "
                     "smaller k or fewer shards.")

  def body(q, block):
    offset = jax.lax.axis_index(axes) * per_shard
    scores = q @ block.T
    rows = offset + jnp.arange(per_shard)
    scores = jnp.where(rows[None, :] < num_valid, scores, -jnp.inf)
    best, where = jax.lax.top_k(scores, k)
    best = jax.lax.all_gather(best, axes, axis=1, tiled=True)
    found = jax.lax.all_gather(offset + where, axes, axis=1, tiled=True)
    top, pick = jax.lax.top_k(best, k)
    return top, jnp.take_along_axis(found, pick, axis=1)

  queries = sharding_lib.place_always(queries, NamedSharding(mesh, P()))
  corpus = sharding_lib.place_always(corpus, NamedSharding(mesh, P(axes)))
  return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axes)), out_specs=(P(), P()),
                       check_vma=False)(queries, corpus)
