"""Request batches from a leave-one-out split: the two towers' and the ranker's, ratings as actions.

The same split the next-item source reads (``embedlib.data.movielens``):
each user's training ratings in time order, then one validation and one
test rating. A request is a user, the (up to) ``S = history_len`` movies
the user rated before a point in time, and what comes next, in the request
layout of ``embedlib.data.sequences``:

- movies are ids ``0 .. I - 1`` there (the split's movie ``m`` is ``m - 1``;
  the split keeps 0 for padding, requests pad with -1);
- MovieLens has no authors: every movie has author 0 (``num_authors=1``);
- ratings are actions (``ACTIONS``): ``rated`` on every movie a user rated,
  ``liked`` where the rating is at least ``like_rating``; a history event
  carries both, multi-hot;
- the history is in time order, right-padded with -1.

Training requests (an endless stream): one per training rating but each
user's first (it has no history), every one once per epoch, in an order
shuffled per epoch by ``seed``; batches run on across epochs without
padding, so every row of every batch is a real request. Eval requests: one
per user, the validation movie after the training ratings (``kind="valid"``)
or the test movie after them and the validation movie (``kind="test"``);
the last batch is filled out with rows of weight 0.

- ``RetrievalRequests`` (the two towers): the request's ``item`` is the
  movie rated next; eval rows carry ``weight`` and, with
  ``exclude_seen``, ``exclude`` (the user's earlier movies, the split's
  ids, 0-padded), for full ranking over every movie.
- ``RankingRequests`` (the ranker): the candidates are the movie rated next
  and ``C - 1`` movies the user has not rated (training: not among the
  training ratings; eval: never), drawn uniformly, the rated one at a
  random slot; its labels are its actions, the others' 0. Eval rows of
  weight 0 have every candidate padded (-1), so they count in no metric.

With ``raw_ids=True`` users and movies are the file's own ids instead
(``user`` the rating file's user id; ``history_item``, ``item``,
``candidate_item`` and ``exclude`` its movie ids, -1 padded), exactly as
written, for dynamic tables (``embedlib.DynamicEmbed``): the ids must be
integers in ``[0, 2**31 - 1)`` (every GroupLens release's are), so that they
travel as int32 with -1 as padding.

A batch is a function of its number alone, so setting ``position`` resumes
exactly, and each process makes only its own rows.

>>> import numpy as np, types
>>> from embedlib.data.movielens.split import Ragged
>>> split = types.SimpleNamespace(
...     num_users=1, num_items=6, train_items=Ragged(np.array([1, 2, 3], np.int32),
...     np.array([0, 3])), train_ratings=Ragged(np.array([5.0, 2.0, 4.0], np.float32),
...     np.array([0, 3])), valid_item=np.array([4]), valid_rating=np.array([3.0]),
...     test_item=np.array([5]), test_rating=np.array([4.0]))
>>> batch = RetrievalRequests(split, history_len=3, batch_size=2, kind="train").batch(0)
>>> sorted(zip(batch["item"].tolist(), batch["history_item"].tolist()))
[(1, [0, -1, -1]), (2, [0, 1, -1])]
>>> test = RetrievalRequests(split, history_len=3, batch_size=1, kind="test").batch(0)
>>> test["item"].tolist(), test["history_item"].tolist(), test["history_actions"][0].tolist()
([4], [[1, 2, 3]], [[1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
"""

from __future__ import annotations

import numpy as np

from embedlib.data import _hashing
from embedlib.data.numbered_stream import NumberedStream

TRAIN, VALID, TEST = "train", "valid", "test"
KINDS = (TRAIN, VALID, TEST)
#: The actions a rating is, in label order: the user rated the movie; rated it
#: at least ``like_rating``.
ACTIONS = ("rated", "liked")
#: Raw ids travel as int32, -1 being padding.
RAW_ID_LIMIT = 2**31 - 1


def raw_ids_of(values, what: str) -> np.ndarray:
  """A file's ids as int64, each in ``[0, RAW_ID_LIMIT)``, or ValueError naming the fix."""
  try:
    ids = np.asarray(values).astype(np.int64)
  except (TypeError, ValueError, OverflowError):
    raise ValueError(f"raw {what} ids: the file's ids are not integers (e.g. "
                     f"{np.asarray(values)[:3].tolist()}); raw ids read integer ids. Set "
                     "config.data.raw_ids=False to number them densely.") from None
  bad = (ids < 0) | (ids >= RAW_ID_LIMIT)
  if bad.any():
    raise ValueError(f"raw {what} id {int(ids[bad][0])} lies outside [0, 2**31 - 1), which "
                     "raw MovieLens ids travel in (int32, -1 padding); set "
                     "config.data.raw_ids=False to number them densely.")
  return ids


def _flat(split, kind):
  """Each user's history movies and ratings, flat, with the user's start ``[U + 1]``."""
  items = [np.asarray(s, np.int32) for s in split.train_items]
  ratings = [np.asarray(r, np.float32) for r in split.train_ratings]
  if kind == TEST:  # the validation rating joins the history
    items = [np.append(s, np.int32(v)) for s, v in zip(items, split.valid_item)]
    ratings = [np.append(r, np.float32(v)) for r, v in zip(ratings, split.valid_rating)]
  starts = np.zeros(len(items) + 1, np.int64)
  np.cumsum([len(s) for s in items], out=starts[1:])
  return np.concatenate(items), np.concatenate(ratings), starts


class _Requests(NumberedStream):
  """The stream both request sources share: which user and point in time each row is."""

  def __init__(self, split, *, history_len: int, batch_size: int, seed: int = 0,
               kind: str = TRAIN, like_rating: float = 4.0, raw_ids: bool = False,
               process_index: int = 0, process_count: int = 1):
    if kind not in KINDS:
      raise ValueError(f"{type(self).__name__}: kind={kind!r}; use one of {KINDS}.")
    if history_len < 1:
      raise ValueError(f"config.data.history_len must be >= 1, got {history_len}.")
    if getattr(split, "train_ratings", None) is None:
      raise ValueError("the split has no ratings; build it with movielens.leave_one_out.")
    super().__init__(batch_size=batch_size, process_index=process_index,
                     process_count=process_count,
                     num_batches=None if kind == TRAIN else -(-split.num_users // batch_size))
    self.kind, self.history_len, self.seed = kind, int(history_len), int(seed)
    self.like_rating = float(like_rating)
    self.num_users, self.num_items = int(split.num_users), int(split.num_items)
    self._items, self._ratings, self._starts = _flat(split, kind)
    self._user_of = np.repeat(np.arange(self.num_users), np.diff(self._starts))
    self._key = _hashing.derive_key(self.seed, "movielens_requests", kind)
    self.raw_ids = bool(raw_ids)
    if self.raw_ids:
      if getattr(split, "raw_item_ids", None) is None:
        raise ValueError("raw_ids=True: the split has no raw ids; build it with "
                         "movielens.leave_one_out(movielens.load(path)).")
      self.raw_user_ids = raw_ids_of(split.raw_user_ids, "user")
      # Entry 0 of the split's items is padding: it stays -1.
      self.raw_item_ids = np.concatenate([[-1], raw_ids_of(split.raw_item_ids[1:], "movie")])
    if kind == TRAIN:
      # Every training rating with one before it is a target.
      self._targets = np.flatnonzero(np.arange(len(self._items)) > self._starts[self._user_of])
      if not len(self._targets):
        raise ValueError("the split has no training target: every user's training ratings "
                         "hold one movie; use data with more ratings per user.")
      self._order_epoch, self._order = -1, None
    else:
      self._held_out = np.asarray(split.test_item if kind == TEST else split.valid_item, np.int32)
      held = split.test_rating if kind == TEST else split.valid_rating
      self._held_rating = np.asarray(held, np.float32)
      self._both_held = np.stack([np.asarray(split.valid_item, np.int32),
                                  np.asarray(split.test_item, np.int32)], axis=1)

  @property
  def requests_per_epoch(self) -> int:
    """Training requests in an epoch: every training rating but each user's first."""
    return len(self._targets) if self.kind == TRAIN else self.num_users

  def _rows(self, index):
    """Global request numbers of this process's rows of batch ``index``."""
    first = index * self.batch_size + self.process_index * self.local_batch_size
    return np.arange(first, first + self.local_batch_size, dtype=np.int64)

  def _train_rows(self, numbers):
    """``(user, flat index of the target)`` of training requests ``numbers``."""
    n = len(self._targets)
    epochs, within = np.divmod(numbers, n)
    picked = np.empty(len(numbers), np.int64)
    for epoch in np.unique(epochs):
      if epoch != self._order_epoch:
        self._order_epoch = epoch
        self._order = np.random.default_rng([self.seed, int(epoch)]).permutation(n)
      here = epochs == epoch
      picked[here] = self._targets[self._order[within[here]]]
    return self._user_of[picked], picked

  def _history(self, users, ends):
    """The up to ``S`` movies before flat index ``ends`` of each user, right-padded."""
    s = self.history_len
    first = np.maximum(self._starts[users], ends - s)
    idx = first[:, None] + np.arange(s)[None, :]
    real = idx < ends[:, None]
    safe = np.minimum(idx, len(self._items) - 1)
    items = np.where(real, self._items[safe] - 1, -1).astype(np.int32)
    ratings = np.where(real, self._ratings[safe], np.nan)
    return {
        "user": users.astype(np.int64),
        "history_item": items,
        "history_author": np.where(real, 0, -1).astype(np.int32),
        "history_actions": self.actions(ratings, real),
    }

  def actions(self, ratings, real):
    """Multi-hot ``ACTIONS`` ``[..., 2]`` of ratings (``real``: a rating is there)."""
    liked = real & (np.nan_to_num(ratings, nan=-np.inf) >= self.like_rating)
    return np.stack([real, liked], axis=-1).astype(np.float32)

  def _requests(self, index):
    """``(history batch, next movie [B] (split ids), its rating [B], users, weight [B])``."""
    numbers = self._rows(index)
    if self.kind == TRAIN:
      users, target = self._train_rows(numbers)
      batch = self._history(users, target)
      return batch, self._items[target], self._ratings[target], users, np.ones(len(users),
                                                                             np.float32)
    weight = (numbers < self.num_users).astype(np.float32)
    users = np.where(numbers < self.num_users, numbers, 0)  # padding rows repeat user 0
    batch = self._history(users, self._starts[users + 1])
    return batch, self._held_out[users], self._held_rating[users], users, weight

  def seen(self, users):
    """Each user's rated movies (split ids), sorted: training requests the training
    ratings, eval requests every rating (the held-out ones too)."""
    out = []
    for u in users:
      s = self._items[self._starts[u]:self._starts[u + 1]]
      if self.kind != TRAIN:
        s = np.concatenate([s, self._both_held[u]])
      out.append(np.unique(s))
    return out


  def _as_raw(self, batch: dict) -> dict:
    """``batch`` with the file's user and movie ids (``raw_ids``), padding kept at -1."""
    if not self.raw_ids:
      return batch
    out = dict(batch, user=self.raw_user_ids[batch["user"]])
    for key in ("history_item", "item", "candidate_item"):
      if key in batch:  # request movies are split ids - 1, -1 padding
        out[key] = self.raw_item_ids[batch[key] + 1].astype(np.int32)
    if "exclude" in batch:  # split ids, 0 padding
      out["exclude"] = self.raw_item_ids[batch["exclude"]].astype(np.int32)
    return out


class RetrievalRequests(_Requests):
  """The two towers' requests: a history and the movie rated next (module docstring).

  Args:
    split: a leave-one-out split with ratings (``movielens.leave_one_out``).
    history_len: ``S``, the most history movies a request holds.
    batch_size: global requests per batch; each process yields
      ``batch_size // process_count``.
    seed: shuffles the training requests per epoch.
    kind: ``"train"``, ``"valid"`` or ``"test"``.
    like_rating: the least rating that is a ``liked`` action.
    raw_ids: yield the file's user and movie ids (module docstring).
    exclude_seen: eval rows carry ``exclude``, the user's movies before the
      held-out one.
    process_index, process_count: this process's slice of each batch.
  """

  def __init__(self, split, *, exclude_seen: bool = False, **kw):
    super().__init__(split, **kw)
    self.exclude_seen = exclude_seen
    if self.kind != TRAIN:
      self.exclude_width = int(np.diff(self._starts).max(initial=1))

  def catalogue(self) -> np.ndarray:
    """Each movie's author, int32 ``[num_items]``: all 0 (MovieLens has no authors)."""
    return np.zeros(self.num_items, np.int32)

  def batch(self, index: int) -> dict:
    """This process's rows of global batch ``index`` (position unchanged)."""
    batch, item, _, users, weight = self._requests(index)
    batch["item"] = (item - 1).astype(np.int32)
    batch["author"] = np.zeros(len(item), np.int32)
    if self.kind != TRAIN:
      batch["weight"] = weight
      if self.exclude_seen:
        batch["exclude"] = np.zeros((len(users), self.exclude_width), np.int32)
        for row, u in enumerate(users):
          earlier = self._items[self._starts[u]:self._starts[u + 1]]
          batch["exclude"][row, :len(earlier)] = earlier
    return self._as_raw(batch)


class RankingRequests(_Requests):
  """The ranker's requests: a history, the movie rated next among unrated ones (module docstring).

  Args:
    split: a leave-one-out split with ratings (``movielens.leave_one_out``).
    history_len: ``S``, the most history movies a request holds.
    num_candidates: ``C``: the rated movie and ``C - 1`` unrated ones.
    batch_size: global requests per batch; each process yields
      ``batch_size // process_count``.
    seed: shuffles the training requests per epoch and draws the unrated movies.
    kind: ``"train"``, ``"valid"`` or ``"test"``.
    like_rating: the least rating that is a ``liked`` action.
    raw_ids: yield the file's user and movie ids (module docstring).
    process_index, process_count: this process's slice of each batch.
  """

  def __init__(self, split, *, num_candidates: int, **kw):
    super().__init__(split, **kw)
    if num_candidates < 2:
      raise ValueError(f"the ranker's candidates: {num_candidates}; give at least 2 (the "
                       "rated movie and one it is ranked against).")
    self.num_candidates = int(num_candidates)
    if not np.isfinite(self._ratings).any():
      raise ValueError("the ratings file holds no ratings, so no movie is 'liked'; the "
                       "ranker's actions need them (the two towers do not).")
    longest = int(np.diff(self._starts).max()) + (self.kind != TRAIN)
    if longest + self.num_candidates - 1 > self.num_items:
      raise ValueError(f"a user rated {longest} of the {self.num_items} movies, too many to "
                       f"draw {self.num_candidates - 1} unrated ones; lower the candidates.")

  def _unrated(self, users, numbers):
    """``C - 1`` movies per row, uniform over the ones the user has not rated (split ids)."""
    c = self.num_candidates
    slots = (numbers[:, None].astype(np.uint64) * np.uint64(c)
             + np.arange(c, dtype=np.uint64)[None, :])
    draw = _hashing.uniform(_hashing.hash_u64(_hashing.derive_key(self._key, "unrated"), slots))
    out = np.empty((len(users), c - 1), np.int32)
    for row, seen in enumerate(self.seen(users)):
      # The r-th unrated movie (from 0) is r + 1 + the rated ones at or below it.
      free = self.num_items - len(seen)
      r = np.minimum((draw[row, :c - 1] * free).astype(np.int64), free - 1)
      below = seen - 1 - np.arange(len(seen))  # unrated movies below each rated one
      out[row] = r + 1 + np.searchsorted(below, r, side="right")
    return out, draw[:, c - 1]

  def batch(self, index: int) -> dict:
    """This process's rows of global batch ``index`` (position unchanged)."""
    batch, item, rating, users, weight = self._requests(index)
    numbers = self._rows(index)
    unrated, slot_draw = self._unrated(users, numbers)
    c = self.num_candidates
    slot = np.minimum((slot_draw * c).astype(np.int64), c - 1)
    others = np.arange(c)[None, :] != slot[:, None]
    candidates = np.empty((len(users), c), np.int32)
    candidates[others] = unrated.reshape(-1)
    candidates[np.arange(len(users)), slot] = item
    labels = np.zeros((len(users), c, len(ACTIONS)), np.float32)
    labels[np.arange(len(users)), slot] = self.actions(rating, np.ones(len(users), bool))
    real = weight > 0
    batch["candidate_item"] = np.where(real[:, None], candidates - 1, -1).astype(np.int32)
    batch["candidate_author"] = np.where(batch["candidate_item"] >= 0, 0, -1).astype(np.int32)
    batch["labels"] = labels * real[:, None, None]
    return self._as_raw(batch)
