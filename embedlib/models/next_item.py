"""What the next-item encoders (SASRec, HSTU) share: the input embedding and tied logits.

A next-item batch (``embedlib.data.next_item``) holds each row's items
left-padded with 0 to ``max_len``; the encoder returns one vector per
position, and position ``i``'s vector scores every item as the one after
item ``i``, through the item table itself (``ShardedEmbed.attend``): the
output layer is tied to the input embedding, so an item vocabulary of any
size is split over the mesh like any table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from embedlib import options
from embedlib.embed import ShardedEmbed
from embedlib.models.blocks import no_dropout


def causal_mask(valid: jax.Array) -> jax.Array:
  """Which keys each query may attend to: earlier or equal real positions, bool ``[B, 1, L, L]``.

  A padded query attends to itself alone, so no row of the mask is empty
  (its output is never read).

  >>> causal_mask(jnp.array([[False, True, True]]))[0, 0].astype(int)
  Array([[1, 0, 0],
         [0, 1, 0],
         [0, 1, 1]], dtype=int32)
  """
  length = valid.shape[1]
  earlier = jnp.tril(jnp.ones((length, length), bool))
  mask = earlier[None] & valid[:, None, :]
  return (mask | jnp.eye(length, dtype=bool)[None])[:, None]


class NextItemEmbed(nnx.Module):
  """Item rows (zero at padding) times ``sqrt(width)`` if asked, plus learned positions.

  >>> from flax import nnx
  >>> items = ShardedEmbed(11, 8, rngs=nnx.Rngs(0))
  >>> x, valid = NextItemEmbed(items, max_len=4, rngs=nnx.Rngs(0))(jnp.array([[0, 0, 3, 7]]))
  >>> x.shape, valid.tolist()
  ((1, 4, 8), [[False, False, True, True]])

  Args:
    items: the item table, ``num_items + 1`` rows (row 0: padding).
    max_len: ``L``, the positions.
    scale: multiply the item rows by ``sqrt(width)`` (the SASRec paper's).
    rngs: random number generators.
  """

  def __init__(self, items: ShardedEmbed, *, max_len: int, scale: bool = False,
               rngs: nnx.Rngs):
    if max_len < 1:
      raise ValueError(f"config.data.max_len must be >= 1, got {max_len}.")
    self.items = items
    self.max_len = max_len
    self.scale = scale
    self.positions = nnx.Embed(max_len, items.features, rngs=rngs)
    self.norm = nnx.LayerNorm(items.features, rngs=rngs)

  def __call__(self, items: jax.Array, dropout=no_dropout) -> tuple[jax.Array, jax.Array]:
    """``items`` int ``[B, L]`` -> (``x [B, L, width]`` normalised, ``valid`` bool ``[B, L]``)."""
    if items.shape[1] != self.max_len:
      raise ValueError(f"next-item rows hold {items.shape[1]} items, the model "
                       f"config.data.max_len={self.max_len}; build both from one config.")
    valid = items > 0
    rows = self.items(items) * valid[..., None].astype(self.items.dtype)
    if self.scale:
      rows = rows * jnp.sqrt(jnp.asarray(self.items.features, rows.dtype))
    x = rows + self.positions(jnp.arange(self.max_len))[None]
    return dropout(self.norm(x)), valid

  def logits(self, hidden: jax.Array, *, vocab_split: bool = False):
    """Scores of every item row (0 included) from ``hidden [..., width]``: ``[..., num_items + 1]``.

    ``vocab_split``: leave each device the logits of the rows it holds,
    where the table is split by rows (a ``VocabShardedLogits`` when the
    split doesn't divide the vocabulary), for ``vocab_parallel_cross_entropy``.
    """
    plan = self.items.plan
    if vocab_split and self.items.mesh is not None and plan.strategy in options.ROW_BLOCKS:
      spec = P(*(None,) * (hidden.ndim - 1), plan.table_axes)
      return self.items.attend(hidden, out_sharding=spec)
    return self.items.attend(hidden)
