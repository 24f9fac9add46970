"""``MultiHashEmbed``: an id's k hashed rows of one sharded table, combined.

The hashing itself (``embedlib.data.MultiHash``) runs on the host, so the
rows are the same on every host and device count; this module looks the
``k`` rows up in one ``ShardedEmbed`` and combines them: concatenated and
projected (the default), or summed. Row 0 is padding: it is looked up as a
zero vector with no gradient (``ShardedEmbed``'s invalid id), and the
projection has no bias, so a padded position embeds to exactly zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib.data.multi_hash import PAD_ROW, MultiHash
from embedlib.embed import ShardedEmbed

CONCAT = "concat"
SUM = "sum"
COMBINERS = (CONCAT, SUM)


class MultiHashEmbed(nnx.Module):
  """Embeds hashed rows ``[..., k]`` to ``[..., out_features]``.

  >>> import numpy as np
  >>> from flax import nnx
  >>> from embedlib.data import MultiHash
  >>> hasher = MultiHash(num_buckets=1024, num_hashes=3)
  >>> emb = MultiHashEmbed(hasher, 8, out_features=16, rngs=nnx.Rngs(0))
  >>> rows = hasher(np.array([[5, 10**12, -1]]))          # on the host
  >>> out = emb(rows)
  >>> out.shape, bool((out[0, 2] == 0).all())              # padding embeds to 0
  ((1, 3, 16), True)

  Args:
    hasher: the hash functions (``num_buckets`` is the table's row count).
    features: width of each row.
    combiner: ``"concat"`` (the ``k`` rows side by side, then a linear
      projection without bias to ``out_features``) or ``"sum"``.
    out_features: output width; default ``features``. ``"sum"`` outputs
      ``features``.
    rngs: random number generators.
    **embed_kwargs: passed to ``ShardedEmbed`` (``mesh``, ``sharding``,
      ``kernel``, ``name``, ``replicate_below_bytes``, ...).
  """

  def __init__(self, hasher: MultiHash, features: int, *, combiner: str = CONCAT,
               out_features: int | None = None, rngs: nnx.Rngs, **embed_kwargs):
    if combiner not in COMBINERS:
      raise ValueError(f"{hasher.name}.combiner={combiner!r}; use one of {COMBINERS}.")
    if combiner == SUM and out_features not in (None, features):
      raise ValueError(
          f"{hasher.name}: combiner='sum' outputs features={features}, but "
          f"out_features={out_features}; use combiner='concat' to project to another width.")
    self.hasher = hasher
    self.combiner = combiner
    self.features = features
    self.out_features = out_features or features
    embed_kwargs.setdefault("name", hasher.name)
    self.table = ShardedEmbed(hasher.num_buckets, features, rngs=rngs, **embed_kwargs)
    k = hasher.num_hashes
    self.project = (nnx.Linear(k * features, self.out_features, use_bias=False, rngs=rngs)
                    if combiner == CONCAT else None)

  def __call__(self, rows: jax.Array) -> jax.Array:
    """``[..., num_hashes]`` int rows (from ``hasher``) to ``[..., out_features]``."""
    k = self.hasher.num_hashes
    if rows.shape[-1:] != (k,):
      raise ValueError(
          f"{self.hasher.name}: expected rows [..., num_hashes={k}] from "
          f"MultiHash(num_hashes={k}), got shape {tuple(rows.shape)}; hash the ids with "
          "this module's hasher.")
    # Row 0 is padding: an invalid id to the table, so a zero row and no gradient.
    vectors = self.table(jnp.where(rows == PAD_ROW, -1, rows))  # [..., k, features]
    if self.project is None:
      return vectors.sum(axis=-2)
    return self.project(vectors.reshape(rows.shape[:-1] + (k * self.features,)))

  def hash(self, ids):
    """The rows of ``ids`` on the host (numpy), to pass to ``__call__``."""
    return self.hasher(ids)
