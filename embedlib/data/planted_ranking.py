"""Planted ranking requests: a history, candidates, and per-action labels with a known optimum.

Each request is a user (``PlantedWorld``), its history, and ``n`` candidates
(``num_candidates // 2 <= n <= num_candidates``; half of them from the
user's preferred topics, half from any topic, each by popularity within its
topic). The label of action ``a`` on candidate ``c`` is
``Bernoulli(sigmoid(logit_a))`` with::

    logit_a = ACTION_BIAS[a]
            + ACTION_TOPIC[a]   * share(topic of c)      # engaged history events in c's topic / history length
            + ACTION_AUTHOR[a]  * engaged_author(c)      # 1 if the history engaged with c's author
            + ACTION_QUALITY[a] * q_c                    # the item's hidden quality
            + ACTION_USER[a]    * rho_u                  # the user's hidden activity

(``planted_world``'s constants). The labels depend on the history: what
the user engaged with, and with whom. ``with_truth`` yields the true logits
beside each batch, so the eval reports what ranking by them scores
(per-action AUC, NDCG): the best any model can do on the same requests, up
to the labels' sampling noise, which both face.
"""

from __future__ import annotations

import numpy as np

from embedlib.data import _hashing
from embedlib.data import planted_world as world_lib
from embedlib.data.planted_stream import PlantedStream, counters
from embedlib.data.sequences import ACTIONS, SequenceSpec
from embedlib.data.spec import PAD_ID

#: Share of candidates drawn from the user's preferences (the rest: any topic).
PREFERRED = 0.5


class PlantedRankingSource(PlantedStream):
  """Deterministic, resumable, per-process stream of planted ranking requests.

  >>> spec = SequenceSpec(num_items=2000, num_authors=40, history_len=8, num_candidates=4)
  >>> src = PlantedRankingSource(spec, batch_size=16, num_users=100, num_topics=8)
  >>> batch = next(src)
  >>> batch["labels"].shape, src.position
  ((16, 4, 5), 1)
  >>> spec.check_batch(batch)
  >>> src.position = 0; bool((next(src)["labels"] == batch["labels"]).all())
  True

  Args:
    spec: sizes (items, authors, history and candidate lengths, actions).
    batch_size: global batch size.
    num_users: users in the world.
    num_topics: topics in the world.
    seed: chooses the world and the streams.
    split: ``"train"`` and ``"eval"`` draw different requests of one world.
    zipf_exponent: popularity skew within a topic.
    **stream: ``process_index``, ``process_count``, ``num_batches``.
  """

  def __init__(self, spec: SequenceSpec, *, batch_size: int, num_users: int, num_topics: int,
               seed: int = 0, split: str = "train", zipf_exponent: float = 1.0, **stream):
    super().__init__(batch_size=batch_size, **stream)
    if spec.num_candidates < 1:
      raise ValueError(f"config.data.num_candidates must be >= 1 for ranking, got "
                       f"{spec.num_candidates}.")
    if spec.num_actions > world_lib.MAX_ACTIONS:
      raise ValueError(f"config.data.actions names {spec.num_actions} actions; the planted "
                       f"source draws at most {world_lib.MAX_ACTIONS}: {ACTIONS}.")
    self.spec = spec
    self.world = world_lib.PlantedWorld(
        num_items=spec.num_items, num_authors=spec.num_authors, num_topics=num_topics,
        num_users=num_users, seed=seed, zipf_exponent=zipf_exponent)
    self._stream = _hashing.derive_key(seed, "ranking", split)

  def _generate(self, start: int, count: int) -> tuple[dict, np.ndarray]:
    """Requests ``start .. start + count - 1``: the batch and the true logits ``[B, C, A]``."""
    spec, world = self.spec, self.world
    n = counters(start, count)
    draw = lambda name, k: _hashing.uniform(_hashing.hash_u64(
        _hashing.derive_key(self._stream, name), n[:, None] * np.uint64(k)
        + np.arange(k, dtype=np.uint64)))
    users = (draw("user", 1)[:, 0] * world.num_users).astype(np.int64)
    history = world.history(n, users, spec.history_len, spec.num_actions, stream=self._stream)

    c, a = spec.num_candidates, spec.num_actions
    low = max(1, c // 2)
    present = np.arange(c) < (low + (draw("count", 1)[:, 0] * (c - low + 1)).astype(np.int64))[:, None]
    preferred = world.draw_topics(world.user_topics(users)[:, None, :], draw("topic", c))
    topic = np.where(draw("preferred", c) < PREFERRED, preferred,
                     (draw("any_topic", c) * world.num_topics).astype(np.int64))
    item = world.draw_items(topic, draw("item", c))
    author = world.item_author[item]

    share = np.take_along_axis(world.engaged_topic_share(history), topic, axis=1)  # [B, C]
    engaged_authors = np.where(history["engaged"], history["author"], PAD_ID)
    engaged_author = (author[:, :, None] == engaged_authors[:, None, :]).any(axis=-1)
    logits = (world_lib.ACTION_BIAS[:a]
              + world_lib.ACTION_TOPIC[:a] * share[..., None]
              + world_lib.ACTION_AUTHOR[:a] * engaged_author[..., None]
              + world_lib.ACTION_QUALITY[:a] * world.item_quality[item][..., None]
              + world_lib.ACTION_USER[:a] * world.user_activity(users)[:, None, None])
    coins = draw("labels", c * a).reshape(count, c, a)
    labels = (coins < 1.0 / (1.0 + np.exp(-logits))) & present[..., None]
    batch = {
        "user": world.user_raw_id(users),
        "history_item": history["item"],
        "history_author": history["author"],
        "history_actions": history["actions"],
        "candidate_item": np.where(present, item, PAD_ID).astype(np.int32),
        "candidate_author": np.where(present, author, PAD_ID).astype(np.int32),
        "labels": labels.astype(np.float32),
    }
    return batch, logits

