"""Pre-norm transformer blocks over a masked sequence, and the candidate-isolation mask.

A ranking request is one sequence ``[user | history (S) | candidates (C)]``.
``isolation_mask`` lets the user and history tokens attend to each other
(bidirectionally, or causally), never to candidates, and lets each
candidate attend to the user, the history and itself only. With every
candidate at the same position, a candidate's output is then a function of
the user, the history and that candidate alone: the other candidates of the
request can be permuted, added or removed without changing it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib.models.blocks import MLP, no_dropout


def isolation_mask(history_valid: jax.Array, candidate_valid: jax.Array, *,
                   num_user_tokens: int = 1, causal: bool = False) -> jax.Array:
  """Which keys each query may attend to: bool ``[B, 1, L, L]``, ``L = U + S + C``.

  >>> m = isolation_mask(jnp.array([[True, False]]), jnp.array([[True, True]]))
  >>> m[0, 0].astype(int)                       # rows: queries; columns: keys
  Array([[1, 1, 0, 0, 0],
         [1, 1, 0, 0, 0],
         [1, 1, 0, 0, 0],
         [1, 1, 0, 1, 0],
         [1, 1, 0, 0, 1]], dtype=int32)

  Args:
    history_valid: bool ``[B, S]``, the real history events.
    candidate_valid: bool ``[B, C]`` (a padded candidate still attends, to
      keep every row of the mask non-empty; its output is ignored).
    num_user_tokens: ``U``, user tokens at the front (always real).
    causal: user and history tokens attend only to themselves and earlier
      ones (candidates still see the whole history).

  Returns:
    The mask, broadcasting over attention heads.
  """
  b, s = history_valid.shape
  c = candidate_valid.shape[1]
  context = jnp.concatenate([jnp.ones((b, num_user_tokens), bool), history_valid], axis=1)
  n = num_user_tokens + s
  to_context = jnp.broadcast_to(context[:, None, :], (b, n + c, n))
  if causal:
    earlier = jnp.tril(jnp.ones((n, n), bool))
    to_context = to_context & jnp.concatenate([earlier, jnp.ones((c, n), bool)])[None]
  to_candidates = jnp.concatenate([jnp.zeros((n, c), bool), jnp.eye(c, dtype=bool)])
  to_candidates = jnp.broadcast_to(to_candidates[None], (b, n + c, c))
  return jnp.concatenate([to_context, to_candidates], axis=2)[:, None]


class Attention(nnx.Module):
  """Multi-head self-attention through ``jax.nn.dot_product_attention``, with a mask.

  >>> from flax import nnx
  >>> att = Attention(16, 4, rngs=nnx.Rngs(0))
  >>> att(jnp.ones((2, 5, 16)), jnp.ones((2, 1, 5, 5), bool)).shape
  (2, 5, 16)
  """

  def __init__(self, width: int, num_heads: int, *, rngs: nnx.Rngs):
    if width % num_heads:
      raise ValueError(f"config.model.width={width} must divide into num_heads={num_heads} "
                       "heads; pick a width that is a multiple of num_heads.")
    self.num_heads = num_heads
    self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
    self.out = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """``x [B, L, width]``, ``mask`` bool ``[B, 1, L, L]`` (True: attend) -> ``[B, L, width]``."""
    b, length, width = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(b, length, 3, self.num_heads, -1), 3, axis=2)
    out = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], mask=mask)
    return self.out(out.reshape(b, length, width))


class Block(nnx.Module):
  """``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, width: int, num_heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.attention = Attention(width, num_heads, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.mlp = MLP(width, (mlp_ratio * width, width), activation=jax.nn.gelu, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array, dropout=no_dropout) -> jax.Array:
    """``dropout``: applied to each residual branch (``blocks.RowDropout`` in training)."""
    x = x + dropout(self.attention(self.norm1(x), mask))
    return x + dropout(self.mlp(self.norm2(x)))


class Transformer(nnx.Module):
  """``num_layers`` blocks and a final norm.

  A Python loop over the blocks rather than ``nnx.scan``: the layers hold no
  tables, but a scan would make any lookup added to them invisible to
  ``embedlib.optim.value_and_grad``.

  >>> from flax import nnx
  >>> t = Transformer(8, num_layers=2, num_heads=2, rngs=nnx.Rngs(0))
  >>> t(jnp.ones((1, 3, 8)), jnp.ones((1, 1, 3, 3), bool)).shape
  (1, 3, 8)
  """

  def __init__(self, width: int, *, num_layers: int, num_heads: int, mlp_ratio: int = 4,
               rngs: nnx.Rngs):
    if num_layers < 1:
      raise ValueError(f"config.model.num_layers must be >= 1, got {num_layers}.")
    self.blocks = nnx.List([Block(width, num_heads, mlp_ratio, rngs=rngs)
                            for _ in range(num_layers)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array, dropout=no_dropout) -> jax.Array:
    for block in self.blocks:
      x = block(x, mask, dropout)
    return self.norm(x)
