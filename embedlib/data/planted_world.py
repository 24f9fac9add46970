"""The hidden world behind the planted request sources: topics, authors, items, users.

Everything is a pure function of ``seed`` (splitmix64 counters, as in
``synthetic.py``), so every process and every restart sees the same world:

* ``num_topics`` topics; author ``a`` writes about topic ``a mod num_topics``;
  item ``i`` is by author ``hash(i) mod num_authors`` and so has that
  author's topic.
* Within a topic, items have Zipf popularity: the item of (hashed) rank
  ``r`` is drawn with probability ``~ (r + 1) ** -zipf_exponent``.
* Each item has a hidden quality ``q_i ~ N(0, 1)``.
* User ``u`` has topic preferences ``pi_u = softmax(2 g_u)``,
  ``g_u ~ N(0, I)``, and an activity ``rho_u ~ N(0, 1)``; its raw id is a
  40-bit hash of ``u`` (ids look like a production system's: sparse, large).

A request's history is ``n`` events (``history_len // 2 <= n <=
history_len``), each an item of a topic drawn from ``pi_u`` (10% from a
uniform topic), with its author and the actions the user took on it
(``history_actions``). The sources (``planted_ranking``, ``planted_retrieval``)
draw what follows the history from it.
"""

from __future__ import annotations

import numpy as np

from embedlib.data import _hashing
from embedlib.data.spec import PAD_ID

#: Sharpness of a user's topic preferences.
USER_TOPIC_SCALE = 2.0
#: Share of history events (and candidates) from a uniformly drawn topic.
EXPLORE = 0.1
#: Raw user ids are this many bits wide.
USER_ID_BITS = 40
#: Per action (click, like, reply, share, dwell): base rate, and the weights
#: of the history's engagement with the item's topic, an engaged author, the
#: item's quality and the user's activity. A history event's actions use the
#: user's own topic preference in place of the first two (``history_actions``).
ACTION_BIAS = np.array([-1.2, -2.2, -3.0, -3.2, -1.6])
ACTION_TOPIC = np.array([4.0, 4.0, 3.0, 3.0, 3.5])
ACTION_AUTHOR = np.array([0.6, 1.5, 2.0, 0.6, 0.4])
ACTION_QUALITY = np.array([0.5, 0.8, 0.3, 1.2, 0.8])
ACTION_USER = np.array([0.3, 0.3, 0.6, 0.3, 0.0])
MAX_ACTIONS = len(ACTION_BIAS)


class PlantedWorld:
  """Topics, authors, items and users with hidden factors, from ``seed``.

  >>> w = PlantedWorld(num_items=1000, num_authors=40, num_topics=8, num_users=100)
  >>> w.item_author.shape, bool(w.item_topic.max() < 8)
  ((1000,), True)
  >>> h = w.history(np.arange(4, dtype=np.uint64), np.arange(4), 6, 5)
  >>> h["item"].shape, h["actions"].shape
  ((4, 6), (4, 6, 5))

  Args:
    num_items: items ``[0, num_items)``.
    num_authors: authors ``[0, num_authors)``.
    num_topics: topics; every topic needs at least one item.
    num_users: users ``[0, num_users)``.
    seed: chooses the world.
    zipf_exponent: popularity skew within a topic.
  """

  def __init__(self, *, num_items: int, num_authors: int, num_topics: int, num_users: int,
               seed: int = 0, zipf_exponent: float = 1.0):
    for name, value in (("num_items", num_items), ("num_authors", num_authors),
                        ("num_topics", num_topics), ("num_users", num_users)):
      if value < 1:
        raise ValueError(f"config.data.{name} must be >= 1, got {value}.")
    if num_authors < num_topics:
      raise ValueError(f"config.data.num_authors={num_authors} is fewer than num_topics="
                       f"{num_topics}; each topic needs an author: raise num_authors.")
    self.num_items, self.num_authors = num_items, num_authors
    self.num_topics, self.num_users = num_topics, num_users
    self.zipf_exponent = float(zipf_exponent)
    key = _hashing.derive_key(seed, "world")
    self._key = key
    items = np.arange(num_items, dtype=np.uint64)
    self.item_author = (_hashing.hash_u64(_hashing.derive_key(key, "author"), items)
                        % np.uint64(num_authors)).astype(np.int32)
    self.item_topic = (self.item_author % num_topics).astype(np.int32)
    self.item_quality = _hashing.normal(
        _hashing.hash_u64(_hashing.derive_key(key, "quality"), items)).astype(np.float32)
    # Items grouped by topic, in (hashed) popularity order within it.
    rank_key = _hashing.hash_u64(_hashing.derive_key(key, "rank"), items)
    self.by_topic = np.lexsort((rank_key, self.item_topic)).astype(np.int32)
    counts = np.bincount(self.item_topic, minlength=num_topics)
    if (counts == 0).any():
      raise ValueError(f"config.data.num_items={num_items} leaves topic "
                       f"{int(np.argmin(counts))} without items; raise num_items or lower "
                       "num_topics.")
    self.topic_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(num_items) - np.repeat(self.topic_start, counts)
    weight = (rank + 1.0) ** -self.zipf_exponent
    cum = np.cumsum(weight)
    before = np.repeat(np.concatenate([[0.0], cum[np.cumsum(counts)[:-1] - 1]]), counts)
    total = np.repeat(cum[np.cumsum(counts) - 1], counts) - before
    within = (cum - before) / total  # (0, 1], ascending within a topic
    #: ``topic + cumulative popularity`` in ``by_topic`` order: a search key.
    self._search = np.repeat(np.arange(num_topics, dtype=np.float64), counts) + within
    #: log P(item | its topic), indexed by item id.
    self.item_log_pop = np.empty(num_items, np.float64)
    self.item_log_pop[self.by_topic] = np.log(weight / total)

  # -- users -------------------------------------------------------------------------

  def user_raw_id(self, users: np.ndarray) -> np.ndarray:
    """Sparse 40-bit raw ids (int64) of user indices."""
    bits = _hashing.hash_u64(_hashing.derive_key(self._key, "user_id"), users.astype(np.uint64))
    return (bits >> np.uint64(64 - USER_ID_BITS)).astype(np.int64)

  def user_topics(self, users: np.ndarray) -> np.ndarray:
    """``pi_u``: float64 ``[..., num_topics]`` topic preferences."""
    keys = np.array([_hashing.derive_key(self._key, "user_topic", t)
                     for t in range(self.num_topics)], np.uint64)
    g = _hashing.normal(_hashing.hash_u64(keys, users.astype(np.uint64)[..., None]))
    z = USER_TOPIC_SCALE * g
    z -= z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)

  def user_activity(self, users: np.ndarray) -> np.ndarray:
    return _hashing.normal(_hashing.hash_u64(_hashing.derive_key(self._key, "activity"),
                                             users.astype(np.uint64)))

  # -- draws ---------------------------------------------------------------------------

  def draw_topics(self, probs: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Topics drawn from ``probs [..., T]`` by inverse CDF: one per ``uniform [...]``."""
    cum = np.cumsum(probs, axis=-1)
    cum /= cum[..., -1:]
    return np.minimum((cum < uniform[..., None]).sum(axis=-1), self.num_topics - 1)

  def draw_items(self, topics: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Items of ``topics`` by popularity within the topic (int32, the shape of ``topics``)."""
    pos = np.searchsorted(self._search, topics + uniform, side="left")
    return self.by_topic[np.minimum(pos, self.num_items - 1)]

  def history(self, counters: np.ndarray, users: np.ndarray, history_len: int,
              num_actions: int, stream: int = 0) -> dict:
    """Histories of requests ``counters`` (uint64 ``[B]``) of ``users``.

    Returns:
      ``item``, ``author`` (int32 ``[B, S]``, -1 padded), ``topic`` (int32,
      -1 padded), ``actions`` (float32 ``[B, S, num_actions]``), ``length``
      (``[B]``) and ``engaged`` (bool ``[B, S]``: any action taken).
    """
    b, s = counters.shape[0], history_len
    draw = lambda name, n: _hashing.uniform(_hashing.hash_u64(
        _hashing.derive_key(self._key, stream, name), counters[:, None] * np.uint64(n)
        + np.arange(n, dtype=np.uint64)))
    low = max(1, s // 2)
    length = low + (draw("length", 1)[:, 0] * (s - low + 1)).astype(np.int64)
    present = np.arange(s) < length[:, None]
    pi = self.user_topics(users)
    explore = draw("explore", s) < EXPLORE
    topic = np.where(explore, (draw("uniform_topic", s) * self.num_topics).astype(np.int64),
                     self.draw_topics(pi[:, None, :], draw("topic", s)))
    item = self.draw_items(topic, draw("item", s))
    pref = np.log(self.num_topics * np.take_along_axis(pi, topic, axis=1))  # [B, S]
    logits = (ACTION_BIAS[:num_actions] + 0.3
              + 0.4 * pref[..., None] * ACTION_TOPIC[:num_actions] / 4.0
              + ACTION_QUALITY[:num_actions] * self.item_quality[item][..., None]
              + ACTION_USER[:num_actions] * self.user_activity(users)[:, None, None])
    coins = draw("actions", s * num_actions).reshape(b, s, num_actions)
    actions = (coins < _sigmoid(logits)) & present[..., None]
    return {
        "item": np.where(present, item, PAD_ID).astype(np.int32),
        "author": np.where(present, self.item_author[item], PAD_ID).astype(np.int32),
        "topic": np.where(present, topic, PAD_ID).astype(np.int32),
        "actions": actions.astype(np.float32),
        "length": length,
        "engaged": actions.any(axis=-1),
    }

  def engaged_topic_share(self, history: dict) -> np.ndarray:
    """float64 ``[B, T]``: each topic's share of the history's engaged events (0 if none)."""
    b = history["item"].shape[0]
    share = np.zeros((b, self.num_topics))
    rows, cols = np.nonzero(history["engaged"])
    np.add.at(share, (rows, history["topic"][rows, cols]), 1.0)
    return share / np.maximum(history["length"][:, None], 1)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))
