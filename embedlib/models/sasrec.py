"""SASRec: a causal transformer over a user's recent items, scoring the next one.

Kang and McAuley, "Self-Attentive Sequential Recommendation" (ICDM 2018), as
RecBole trains it: item rows plus learned positions, dropout, ``N`` blocks
of causal self-attention and a GELU MLP, layer norms, and the item table
tied to the output (a softmax over every item). The blocks are the
transformer ranker's pre-norm blocks (``transformer.Transformer``), with
dropout on each residual branch; attention sees the real items at or
before each position only. ``repeat_bias=True`` adds a learned logit for
the items in the row's input (``next_item.NextItemEmbed``), which the
paper's model doesn't have; ``configs/movielens.py`` turns it on.
"""

from __future__ import annotations

import jax
from flax import nnx

from embedlib.embed import ShardedEmbed
from embedlib.models.blocks import no_dropout
from embedlib.models.next_item import NextItemEmbed, causal_mask
from embedlib.models.transformer import Transformer


class SASRec(nnx.Module):
  """Causal self-attention next-item encoder with a tied item table.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> items = ShardedEmbed(21, 8, rngs=nnx.Rngs(0))
  >>> model = SASRec(items, max_len=5, num_layers=1, num_heads=2, rngs=nnx.Rngs(0))
  >>> batch = {"items": jnp.array([[0, 0, 4, 9, 2]])}
  >>> hidden = model(batch)
  >>> hidden.shape, model.logits(hidden[:, -1]).shape   # scores of rows 0..20
  ((1, 5, 8), (1, 21))

  Args:
    items: the item table, ``num_items + 1`` rows (row 0: padding), or a
      ``DynamicEmbed`` read by raw ids (``next_item`` module docstring).
    max_len: ``L``, the most history items a row holds.
    num_layers, num_heads, mlp_ratio: the transformer's.
    scale_embeddings: multiply item rows by ``sqrt(width)``.
    repeat_bias: learn a logit for the items in the row's input
      (``next_item.NextItemEmbed``).
    side: the items' side columns (``next_item.ItemColumns``), or None.
    rngs: random number generators.
  """

  def __init__(self, items: ShardedEmbed, *, max_len: int, num_layers: int, num_heads: int,
               mlp_ratio: int = 4, scale_embeddings: bool = False,
               repeat_bias: bool = False, side=None, rngs: nnx.Rngs):
    self.embed = NextItemEmbed(items, max_len=max_len, scale=scale_embeddings,
                               repeat_bias=repeat_bias, side=side, rngs=rngs)
    self.transformer = Transformer(items.features, num_layers=num_layers, num_heads=num_heads,
                                   mlp_ratio=mlp_ratio, rngs=rngs)

  def to_rows(self, batch: dict) -> dict:
    """A raw-id batch as the dynamic item table's indices (``NextItemEmbed.to_rows``)."""
    return self.embed.to_rows(batch)

  @property
  def items(self) -> ShardedEmbed:
    return self.embed.items

  def __call__(self, batch: dict, dropout=no_dropout) -> jax.Array:
    """``batch["items"]`` int ``[B, L]`` -> ``[B, L, width]``, position ``i`` from items ``<= i``.

    ``dropout``: ``blocks.RowDropout`` in training, none by default.
    """
    x, valid = self.embed(batch["items"], dropout)
    return self.transformer(x, causal_mask(valid), dropout)

  def logits(self, hidden: jax.Array, items: jax.Array | None = None, *,
             vocab_split: bool = False):
    """Every item row's score (``NextItemEmbed.logits``)."""
    return self.embed.logits(hidden, items, vocab_split=vocab_split)
