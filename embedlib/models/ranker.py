"""The transformer ranker with candidate isolation (the seed recommender's design, in NNX).

One sequence per request, ``[user | history (S) | candidates (C)]``:

- the user token is the user's multi-hash embedding (``MultiHashEmbed``);
- a history token embeds the item, its author and the actions taken on it
  (multi-hot, projected), concatenated and projected to ``width``;
- a candidate token embeds the item and its author, projected the same way.

Positions are learned: the user token is position 0, history events
``1 .. S``, and every candidate ``S + 1`` (one shared position: no
candidate's output may depend on where it sits in the request). The
``isolation_mask`` keeps candidates from seeing each other, so each
candidate's ``num_actions`` logits depend on the user, the history and that
candidate only.

The item table is the big one: a ``ShardedEmbed`` split over the mesh and
trained row-sparsely, looked up for the history and for the candidates.
With raw ids it is a ``DynamicEmbed`` (and the user's may be one too):
the history's and the candidates' ids then go to it in one call, one step
of its admission and eviction policy per training step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib.dynamic import DynamicEmbed
from embedlib.models.transformer import Transformer, isolation_mask
from embedlib.strategies import Request


def out_width(embed) -> int:
  """Output width of an embedding module (``ShardedEmbed`` or ``MultiHashEmbed``)."""
  return getattr(embed, "out_features", None) or embed.features


class RankerTrunk(nnx.Module):
  """Embeds ``[user | history | candidates]`` and runs the isolated transformer.

  Used whole by ``TransformerRanker``, and without candidates as the user
  tower of ``TwoTower``.

  Args:
    items: the item embedding (a ``ShardedEmbed`` of item ids, a
      ``MultiHashEmbed`` of hashed rows, or a ``DynamicEmbed`` of raw ids):
      called on the batch's item fields.
    authors: the author embedding, likewise.
    user: the user embedding (``MultiHashEmbed``, or a ``DynamicEmbed`` of raw
      ids), ``out_width == width``.
    num_actions: width of the multi-hot history actions.
    history_len: ``S``.
    width: the transformer's width.
    num_layers, num_heads, mlp_ratio: the transformer's shape.
    action_features: width the multi-hot actions are projected to.
    causal: history tokens attend only to earlier ones.
    rngs: random number generators.
  """

  def __init__(self, *, items, authors, user, num_actions: int, history_len: int, width: int,
               num_layers: int, num_heads: int, mlp_ratio: int = 4, action_features: int = 8,
               causal: bool = False, rngs: nnx.Rngs):
    if out_width(user) != width:
      raise ValueError(f"the user embedding outputs {out_width(user)} features, the "
                       f"transformer's width is {width}; set its out_features to {width}.")
    self.items, self.authors, self.user = items, authors, user
    self.num_actions, self.history_len, self.width = num_actions, history_len, width
    self.causal = causal
    entity = out_width(items) + out_width(authors)
    self.actions = nnx.Linear(num_actions, action_features, rngs=rngs)
    self.history_in = nnx.Linear(entity + action_features, width, rngs=rngs)
    self.candidate_in = nnx.Linear(entity, width, rngs=rngs)
    self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (history_len + 2, width)))
    self.transformer = Transformer(width, num_layers=num_layers, num_heads=num_heads,
                                   mlp_ratio=mlp_ratio, rngs=rngs)

  def _item_rows(self, history_item, candidate_item, history_rows=None):
    """Item embeddings of the history and the candidates (None without candidates)."""
    if candidate_item is None:
      return (self.items(history_item) if history_rows is None else history_rows), None
    if isinstance(self.items, DynamicEmbed):  # one call: one step of its policy
      return self.items.lookup_requests([Request(history_item), Request(candidate_item)])
    return self.items(history_item), self.items(candidate_item)

  def _entity(self, item_rows, authors):
    return jnp.concatenate([item_rows, self.authors(authors)], axis=-1)

  def __call__(self, user, history_item, history_author, history_actions, history_valid,
               candidate_item=None, candidate_author=None, candidate_valid=None,
               history_rows=None):
    """Transformer outputs: ``([B, 1 + S, width], [B, C, width] or None)``.

    Args:
      user: the user embedding's input (``[B, num_hashes]`` hashed rows).
      history_item, history_author: ``[B, S]`` ids (or ``[B, S, k]`` rows).
      history_actions: float ``[B, S, num_actions]`` multi-hot.
      history_valid: bool ``[B, S]``.
      candidate_item, candidate_author: ``[B, C]`` (or ``[B, C, k]``), or None.
      candidate_valid: bool ``[B, C]``, or None.
      history_rows: the history's item embeddings ``[B, S, F]`` where the
        caller looked them up (without candidates), or None.
    """
    s = self.history_len
    positions = self.positions[...]
    user_token = self.user(user)[:, None, :]
    history_rows, candidate_rows = self._item_rows(history_item, candidate_item, history_rows)
    history = self.history_in(jnp.concatenate(
        [self._entity(history_rows, history_author), self.actions(history_actions)], axis=-1))
    tokens = [user_token + positions[0], history + positions[1:s + 1]]
    c = 0
    if candidate_item is not None:
      candidates = self.candidate_in(self._entity(candidate_rows, candidate_author))
      tokens.append(candidates + positions[s + 1])  # one position for every candidate
      c = candidates.shape[1]
    else:
      candidate_valid = jnp.zeros((history_valid.shape[0], 0), bool)
    mask = isolation_mask(history_valid, candidate_valid, causal=self.causal)
    out = self.transformer(jnp.concatenate(tokens, axis=1), mask)
    return out[:, :s + 1], (out[:, s + 1:] if c else None)


class TransformerRanker(nnx.Module):
  """Per-action logits ``[B, C, num_actions]`` for each request's candidates.

  >>> import numpy as np
  >>> from flax import nnx
  >>> from embedlib import ShardedEmbed
  >>> from embedlib.data import MultiHash, SequenceSpec
  >>> from embedlib.models import MultiHashEmbed
  >>> rngs = nnx.Rngs(0)
  >>> trunk = RankerTrunk(
  ...     items=ShardedEmbed(100, 8, rngs=rngs), authors=ShardedEmbed(10, 4, rngs=rngs),
  ...     user=MultiHashEmbed(MultiHash(64, 2), 8, out_features=16, rngs=rngs),
  ...     num_actions=5, history_len=6, width=16, num_layers=1, num_heads=2, rngs=rngs)
  >>> ranker = TransformerRanker(trunk, rngs=rngs)
  >>> batch = SequenceSpec(100, 10, history_len=6, num_candidates=3).zeros(2)
  >>> batch["user"] = trunk.user.hash(batch["user"])
  >>> ranker(batch).shape
  (2, 3, 5)

  Args:
    trunk: the ``RankerTrunk``.
    rngs: random number generators.
  """

  def __init__(self, trunk: RankerTrunk, *, rngs: nnx.Rngs):
    self.trunk = trunk
    self.head = nnx.Linear(trunk.width, trunk.num_actions, rngs=rngs)

  def __call__(self, batch) -> jax.Array:
    """Logits ``[B, C, num_actions]`` from a featurized ranking batch (user rows hashed)."""
    _, candidates = self.trunk(
        batch["user"], batch["history_item"], batch["history_author"],
        batch["history_actions"], valid(batch["history_item"]),
        batch["candidate_item"], batch["candidate_author"], valid(batch["candidate_item"]))
    return self.head(candidates)


def valid(ids: jax.Array) -> jax.Array:
  """Real entries of a -1 padded id list ``[B, L]`` (or hashed rows ``[B, L, k]``, 0 padded)."""
  return ids >= 0 if ids.ndim == 2 else ids[..., 0] > 0
