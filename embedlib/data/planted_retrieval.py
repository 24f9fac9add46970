"""Planted retrieval requests: a history and the item engaged next, with a known optimum.

Each request is a user (``PlantedWorld``), its history, and the one item it
engages with next: a topic drawn from the history,

    P(topic t | history) = FOLLOW * share_t + (1 - FOLLOW) / num_topics,

where ``share_t`` is topic ``t``'s share of the history's engaged events
(uniform when none was engaged), then an item by popularity within that
topic. So ``P(item | history)`` is known exactly, and ranking the whole
catalogue by it gives the best expected recall@K any retriever can reach;
``oracle_top_k`` computes that ranking (exactly: the top K overall lie among
each topic's K most popular items), and ``with_truth`` yields the topic
probabilities ``[B, num_topics]`` beside each batch for it.

The eval corpus is the whole catalogue (``num_items`` items); the eval
requests are drawn apart from the training ones (``split="eval"``).
"""

from __future__ import annotations

import numpy as np

from embedlib.data import _hashing
from embedlib.data import planted_world as world_lib
from embedlib.data.planted_stream import PlantedStream, counters
from embedlib.data.sequences import SequenceSpec

#: Weight of the history's engaged topics in the next item's topic.
FOLLOW = 0.9


class PlantedRetrievalSource(PlantedStream):
  """Deterministic, resumable, per-process stream of planted retrieval requests.

  >>> spec = SequenceSpec(num_items=2000, num_authors=40, history_len=8)
  >>> src = PlantedRetrievalSource(spec, batch_size=16, num_users=100, num_topics=8)
  >>> batch = next(src)
  >>> batch["item"].shape, batch["history_item"].shape
  ((16,), (16, 8))
  >>> spec.check_batch(batch, kind="retrieval")

  Args:
    spec: sizes (items, authors, history length, actions).
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
    self.spec = spec
    self.world = world_lib.PlantedWorld(
        num_items=spec.num_items, num_authors=spec.num_authors, num_topics=num_topics,
        num_users=num_users, seed=seed, zipf_exponent=zipf_exponent)
    self._stream = _hashing.derive_key(seed, "retrieval", split)

  def topic_probs(self, history: dict) -> np.ndarray:
    """``P(topic | history)``, float64 ``[B, num_topics]``."""
    share = self.world.engaged_topic_share(history)
    total = share.sum(axis=1, keepdims=True)
    share = np.where(total > 0, share / np.maximum(total, 1e-12), 1.0 / self.world.num_topics)
    return FOLLOW * share + (1.0 - FOLLOW) / self.world.num_topics

  def _generate(self, start: int, count: int) -> tuple[dict, np.ndarray]:
    """Requests ``start ..``: the batch and ``P(topic | history)`` ``[B, num_topics]``."""
    spec, world = self.spec, self.world
    n = counters(start, count)
    draw = lambda name: _hashing.uniform(_hashing.hash_u64(
        _hashing.derive_key(self._stream, name), n))
    users = (draw("user") * world.num_users).astype(np.int64)
    history = world.history(n, users, spec.history_len, spec.num_actions, stream=self._stream)
    probs = self.topic_probs(history)
    topic = world.draw_topics(probs, draw("topic"))
    item = world.draw_items(topic, draw("item"))
    batch = {
        "user": world.user_raw_id(users),
        "history_item": history["item"],
        "history_author": history["author"],
        "history_actions": history["actions"],
        "item": item.astype(np.int32),
        "author": world.item_author[item].astype(np.int32),
    }
    return batch, probs

  def catalogue(self) -> np.ndarray:
    """Each item's author, int32 ``[num_items]``: the features the corpus is embedded from."""
    return self.world.item_author

  def oracle_top_k(self, topic_probs: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` items of highest ``P(item | history)``, int32 ``[B, k]``, best first.

    Args:
      topic_probs: ``[B, num_topics]`` from ``with_truth``.
      k: how many (at most ``num_items``).
    """
    world = self.world
    k = min(k, world.num_items)
    counts = np.diff(np.append(world.topic_start, world.num_items))
    # The k best overall are among each topic's k most popular items.
    firsts = [world.by_topic[s:s + min(k, c)] for s, c in zip(world.topic_start, counts)]
    pool = np.concatenate(firsts)  # [P]
    scores = (np.log(topic_probs[:, world.item_topic[pool]])
              + world.item_log_pop[pool][None, :])  # [B, P]
    best = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, best, axis=1), axis=1, kind="stable")
    return pool[np.take_along_axis(best, order, axis=1)].astype(np.int32)
