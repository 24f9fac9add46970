"""Two-tower retrieval: a user tower and a candidate tower, L2-normalised, a learnable temperature.

- Candidate tower: the item's multi-hash embedding and its author's
  embedding, concatenated, through an MLP.
- User tower, by config: ``"pooled"`` (the user's multi-hash embedding and
  the mean of the history's event embeddings, through an MLP) or
  ``"trunk"`` (the transformer ranker's trunk over ``[user | history]``,
  mean-pooled over the real tokens, projected).

The history's items go through the candidate tower's item embedding (one
shared table), so a user is described in the space the items live in.
With raw ids that table is a ``DynamicEmbed`` and a training step looks the
history's and the engaged items up in one call (``users_and_candidates``). The
score of a pair is ``<user, item> / temperature``; the temperature is a
parameter, ``exp(log_temperature)``, kept within
``[min_temperature, max_temperature]``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib.dynamic import DynamicEmbed
from embedlib.models.blocks import MLP
from embedlib.models.ranker import RankerTrunk, out_width, valid
from embedlib.strategies import Request

POOLED = "pooled"
TRUNK = "trunk"
USER_TOWERS = (POOLED, TRUNK)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps * eps))


def check_temperature(temperature: float, min_temperature: float, max_temperature: float):
  """Raises ValueError unless ``0 < min <= temperature <= max <= 1``."""
  values = (temperature, min_temperature, max_temperature)
  if not all(math.isfinite(v) for v in values) or not 0 < min_temperature <= temperature <= max_temperature <= 1:
    raise ValueError(
        f"config.model.temperature={temperature} with min_temperature={min_temperature} and "
        f"max_temperature={max_temperature} can't work: the scores are cosine similarities "
        "in [-1, 1] divided by the temperature, so it must be > 0 (a softmax needs a finite "
        "scale) and at most 1 (above, no item can stand out of a batch). Use "
        "0 < min_temperature <= temperature <= max_temperature <= 1, e.g. 0.05 in [0.01, 1].")


class PooledUserTower(nnx.Module):
  """The user's embedding and the mean of its history's events, through an MLP."""

  def __init__(self, *, items, authors, user, num_actions: int, sizes, action_features: int = 8,
               rngs: nnx.Rngs):
    self.items, self.authors, self.user = items, authors, user
    self.actions = nnx.Linear(num_actions, action_features, rngs=rngs)
    events = out_width(items) + out_width(authors) + action_features
    self.mlp = MLP(out_width(user) + events, sizes, rngs=rngs)

  def __call__(self, batch, history_rows=None) -> jax.Array:
    """``[B, sizes[-1]]``; ``history_rows``: the history's item embeddings, if looked up."""
    history_valid = valid(batch["history_item"])
    if history_rows is None:
      history_rows = self.items(batch["history_item"])
    events = jnp.concatenate([history_rows,
                              self.authors(batch["history_author"]),
                              self.actions(batch["history_actions"])], axis=-1)
    weight = history_valid[..., None].astype(events.dtype)
    pooled = (events * weight).sum(1) / jnp.maximum(weight.sum(1), 1.0)
    return self.mlp(jnp.concatenate([self.user(batch["user"]), pooled], axis=-1))


class TrunkUserTower(nnx.Module):
  """The ranker's trunk over ``[user | history]``, mean-pooled over real tokens, projected."""

  def __init__(self, trunk: RankerTrunk, out_features: int, *, rngs: nnx.Rngs):
    self.trunk = trunk
    self.project = nnx.Linear(trunk.width, out_features, rngs=rngs)

  def __call__(self, batch, history_rows=None) -> jax.Array:
    """``[B, out_features]``; ``history_rows``: the history's item embeddings, if looked up."""
    history_valid = valid(batch["history_item"])
    context, _ = self.trunk(batch["user"], batch["history_item"], batch["history_author"],
                            batch["history_actions"], history_valid,
                            history_rows=history_rows)
    real = jnp.concatenate([jnp.ones_like(history_valid[:, :1]), history_valid], axis=1)
    weight = real[..., None].astype(context.dtype)
    return self.project((context * weight).sum(1) / weight.sum(1))


class TwoTower(nnx.Module):
  """L2-normalised user and candidate embeddings and the temperature that scales their scores.

  Args:
    items: the item ``MultiHashEmbed`` (shared by both towers).
    authors: the author ``ShardedEmbed``.
    user_tower: ``PooledUserTower`` or ``TrunkUserTower``, ending in ``features``.
    candidate_sizes: the candidate MLP's widths, ending in ``features``.
    temperature: initial temperature.
    min_temperature, max_temperature: its range.
    learn_temperature: train it (else it stays at ``temperature``).
    mesh: the mesh the batch is split over (for gathering in-batch items).
    rngs: random number generators.
  """

  def __init__(self, *, items, authors, user_tower, candidate_sizes, temperature: float = 0.05,
               min_temperature: float = 0.01, max_temperature: float = 1.0,
               learn_temperature: bool = True, mesh=None, rngs: nnx.Rngs):
    check_temperature(temperature, min_temperature, max_temperature)
    self.items, self.authors, self.user_tower = items, authors, user_tower
    self.candidate_mlp = MLP(out_width(items) + out_width(authors), candidate_sizes, rngs=rngs)
    kind = nnx.Param if learn_temperature else nnx.Variable
    self.log_temperature = kind(jnp.log(jnp.float32(temperature)))
    self.min_temperature, self.max_temperature = min_temperature, max_temperature
    self.mesh = mesh
    self.features = candidate_sizes[-1]

  def temperature(self) -> jax.Array:
    return jnp.clip(jnp.exp(self.log_temperature[...]), self.min_temperature,
                    self.max_temperature)

  def users(self, batch) -> jax.Array:
    """``[B, features]`` unit vectors from a featurized request batch."""
    return l2_normalize(self.user_tower(batch))

  def candidates(self, item_rows: jax.Array, authors: jax.Array, embedded=None) -> jax.Array:
    """``[N, features]`` unit vectors of items (hashed rows ``[N, k]``, or raw ids ``[N]``
    of a dynamic table) and their authors ``[N]``; ``embedded``: the items' embeddings,
    if looked up."""
    if embedded is None:
      embedded = self.items(item_rows)
    x = jnp.concatenate([embedded, self.authors(authors)], axis=-1)
    return l2_normalize(self.candidate_mlp(x))

  def users_and_candidates(self, batch) -> tuple[jax.Array, jax.Array]:
    """``(users(batch), candidates(batch["item"], batch["author"]))`` of a training batch.

    A dynamic item table (raw ids) looks the history's and the engaged items
    up in one call: one step of its admission and eviction policy, so no id
    of the batch can evict another.
    """
    if not isinstance(self.items, DynamicEmbed):
      return self.users(batch), self.candidates(batch["item"], batch["author"])
    history, engaged = self.items.lookup_requests([Request(batch["history_item"]),
                                                   Request(batch["item"])])
    return (l2_normalize(self.user_tower(batch, history_rows=history)),
            self.candidates(batch["item"], batch["author"], embedded=engaged))
