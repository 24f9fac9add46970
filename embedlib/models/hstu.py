"""HSTU: pointwise gated attention with relative position and time biases, for the next item.

Zhai et al., "Actions Speak Louder than Words: Trillion-Parameter Sequential
Transducers for Generative Recommendations" (ICML 2024). Each layer:

    U, V, Q, K = split(SiLU(W_1 LayerNorm(x)))
    A          = SiLU(Q K^T + rab^{p,t}) / L, causal and over real items only
    x         <- x + W_2 (LayerNorm(A V) * U)

The attention is pointwise (SiLU, not a softmax over keys, normalised by the
sequence length ``L``), so a user's intensity of engagement is not averaged
away; ``U`` gates its output. ``rab`` adds, per layer, a learned bias per
relative position ``i - j`` and per bucket of ``log |t_query(i) - t(j)|``,
``t_query(i)`` being the time of the item position ``i`` predicts (known at
request time): the paper's relative attention bias, buckets as its code
cuts them (``floor(ln(max(|dt|, 1)) / 0.301)``, clipped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib.embed import ShardedEmbed
from embedlib.models.blocks import no_dropout
from embedlib.models.next_item import NextItemEmbed, causal_mask

#: The generative-recommenders code's bucket width: ln(dt) / 0.301.
_LOG_BUCKET = 0.301


def time_buckets(query_times: jax.Array, times: jax.Array, num_buckets: int) -> jax.Array:
  """Bucket of ``ln max(|query_times[i] - times[j]|, 1) / 0.301`` per pair: int32 ``[B, L, L]``.

  >>> time_buckets(jnp.array([[10, 1000]]), jnp.array([[0, 10]]), 128).tolist()
  [[[7, 0], [22, 22]]]

  Args:
    query_times: int ``[B, L]``, the time each position predicts for.
    times: int ``[B, L]``, each position's item's time.
    num_buckets: the largest bucket (a larger gap takes it).
  """
  gap = (query_times[:, :, None] - times[:, None, :]).astype(jnp.float32)
  bucket = jnp.floor(jnp.log(jnp.maximum(jnp.abs(gap), 1.0)) / _LOG_BUCKET)
  return jnp.clip(bucket, 0, num_buckets).astype(jnp.int32)


class HSTULayer(nnx.Module):
  """One HSTU layer: gated pointwise attention with relative position and time biases.

  Args:
    width: the model width (``U``, ``V``, ``Q``, ``K`` are each this wide).
    num_heads: heads ``Q``, ``K`` and ``V`` are split into.
    max_len: ``L``: the relative positions are ``0 .. L - 1``.
    num_time_buckets: the time bias's buckets (``time_buckets``).
    rngs: random number generators.
  """

  def __init__(self, width: int, *, num_heads: int, max_len: int, num_time_buckets: int,
               rngs: nnx.Rngs):
    if width % num_heads:
      raise ValueError(f"config.model.width={width} must divide into num_heads={num_heads} "
                       "heads; pick a width that is a multiple of num_heads.")
    self.num_heads = num_heads
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.uvqk = nnx.Linear(width, 4 * width, rngs=rngs)
    self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
    self.out = nnx.Linear(width, width, rngs=rngs)
    init = nnx.initializers.normal(0.02)
    self.position_bias = nnx.Param(init(rngs.params(), (max_len,)))
    self.time_bias = nnx.Param(init(rngs.params(), (num_time_buckets + 1,)))

  def __call__(self, x: jax.Array, mask: jax.Array, buckets: jax.Array,
               dropout=no_dropout) -> jax.Array:
    """``x [B, L, width]``, ``mask`` bool ``[B, 1, L, L]``, ``buckets`` int ``[B, L, L]``."""
    b, length, width = x.shape
    u, v, q, k = jnp.split(jax.nn.silu(self.uvqk(self.norm(x))), 4, axis=-1)
    heads = lambda t: t.reshape(b, length, self.num_heads, -1)
    scores = jnp.einsum("bihd,bjhd->bhij", heads(q), heads(k))
    distance = jnp.clip(jnp.arange(length)[:, None] - jnp.arange(length)[None, :], 0,
                        length - 1)
    bias = self.position_bias[...][distance][None] + self.time_bias[...][buckets]
    weights = jax.nn.silu(scores + bias[:, None]) / length
    weights = jnp.where(mask, weights, 0.0)
    out = jnp.einsum("bhij,bjhd->bihd", weights, heads(v)).reshape(b, length, width)
    return x + self.out(dropout(self.attention_norm(out) * u))


class HSTU(nnx.Module):
  """The HSTU next-item encoder: ``num_layers`` HSTU layers over item rows and positions.

  >>> from flax import nnx
  >>> items = ShardedEmbed(21, 8, rngs=nnx.Rngs(0))
  >>> model = HSTU(items, max_len=4, num_layers=2, num_heads=2, rngs=nnx.Rngs(0))
  >>> batch = {"items": jnp.array([[0, 3, 4, 9]]), "times": jnp.array([[0, 5, 60, 900]]),
  ...          "query_times": jnp.array([[0, 60, 900, 4000]])}
  >>> model(batch).shape
  (1, 4, 8)

  Args:
    items: the item table, ``num_items + 1`` rows (row 0: padding), or a
      ``DynamicEmbed`` read by raw ids (``next_item`` module docstring).
    max_len: ``L``.
    num_layers, num_heads: the layers'.
    num_time_buckets: the time bias's buckets.
    scale_embeddings: multiply item rows by ``sqrt(width)``.
    repeat_bias: learn a logit for the items in the row's input
      (``next_item.NextItemEmbed``).
    side: the items' side columns (``next_item.ItemColumns``), or None.
    rngs: random number generators.
  """

  def __init__(self, items: ShardedEmbed, *, max_len: int, num_layers: int, num_heads: int,
               num_time_buckets: int = 128, scale_embeddings: bool = False,
               repeat_bias: bool = False, side=None, rngs: nnx.Rngs):
    if num_layers < 1:
      raise ValueError(f"config.model.num_layers must be >= 1, got {num_layers}.")
    if num_time_buckets < 1:
      raise ValueError(f"config.model.num_time_buckets must be >= 1, got {num_time_buckets}.")
    self.num_time_buckets = num_time_buckets
    self.embed = NextItemEmbed(items, max_len=max_len, scale=scale_embeddings,
                               repeat_bias=repeat_bias, side=side, rngs=rngs)
    self.layers = nnx.List([
        HSTULayer(items.features, num_heads=num_heads, max_len=max_len,
                  num_time_buckets=num_time_buckets, rngs=rngs) for _ in range(num_layers)])
    self.norm = nnx.LayerNorm(items.features, rngs=rngs)

  def to_rows(self, batch: dict) -> dict:
    """A raw-id batch as the dynamic item table's indices (``NextItemEmbed.to_rows``)."""
    return self.embed.to_rows(batch)

  @property
  def items(self) -> ShardedEmbed:
    return self.embed.items

  def __call__(self, batch: dict, dropout=no_dropout) -> jax.Array:
    """``items``, ``times``, ``query_times`` ``[B, L]`` -> ``[B, L, width]``, causal."""
    x, valid = self.embed(batch["items"], dropout)
    mask = causal_mask(valid)
    buckets = time_buckets(batch["query_times"], batch["times"], self.num_time_buckets)
    for layer in self.layers:
      x = layer(x, mask, buckets, dropout)
    return self.norm(x)

  def logits(self, hidden: jax.Array, items: jax.Array | None = None, *,
             vocab_split: bool = False):
    """Every item row's score (``NextItemEmbed.logits``)."""
    return self.embed.logits(hidden, items, vocab_split=vocab_split)
