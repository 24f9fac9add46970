"""Leave-one-out: each user's last interaction is the test target, the one before
it validation, the rest training (the SASRec paper's and RecBole's ``LS`` split)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from embedlib.data.movielens.interactions import MIN_INTERACTIONS, Interactions


@dataclasses.dataclass(frozen=True, eq=False)
class Ragged:
  """Per-user arrays stored flat: ``ragged[u]`` is ``values[offsets[u]:offsets[u + 1]]`` (a view).

  >>> r = Ragged(np.array([5, 6, 7]), np.array([0, 2, 3]))
  >>> len(r), r[0], r.lengths
  (2, array([5, 6]), array([2, 1]))
  """

  values: np.ndarray
  offsets: np.ndarray

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def __getitem__(self, u: int) -> np.ndarray:
    if not -len(self) <= u < len(self):
      raise IndexError(f"user {u} is out of range for {len(self)} users.")
    u = u % len(self)
    return self.values[self.offsets[u]:self.offsets[u + 1]]

  def __iter__(self) -> Iterator[np.ndarray]:
    return (self[u] for u in range(len(self)))

  @property
  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
  """A leave-one-out split; user ``u`` is row ``u`` of every per-user field.

  Attributes:
    num_users: ``U``.
    num_items: ``I`` (items are ``1 .. I``; 0 is padding).
    item_titles: dense item id -> title, where the files have titles.
    train_items: ``Ragged`` of int32, user ``u``'s training items in time order.
    train_times: ``Ragged`` of int64 seconds, aligned with ``train_items``.
    valid_item, valid_time: ``[U]`` the second-to-last interaction.
    test_item, test_time: ``[U]`` the last interaction.
    train_ratings: ``Ragged`` of float32 ratings aligned with ``train_items``
      (NaN where the file has none), or None.
    valid_rating, test_rating: ``[U]`` float32, the held-out ratings, or None.
    raw_user_ids: ``[U]`` the file's id of each user, or None.
    raw_item_ids: ``[I + 1]`` the file's id of each item (entry 0: padding), or None.
  """

  num_users: int
  num_items: int
  item_titles: dict
  train_items: Ragged
  train_times: Ragged
  valid_item: np.ndarray
  valid_time: np.ndarray
  test_item: np.ndarray
  test_time: np.ndarray
  train_ratings: Ragged | None = None
  valid_rating: np.ndarray | None = None
  test_rating: np.ndarray | None = None
  raw_user_ids: np.ndarray | None = None
  raw_item_ids: np.ndarray | None = None

  @property
  def num_train(self) -> int:
    """Training interactions, all users together."""
    return len(self.train_items.values)

  def __repr__(self) -> str:
    return (f"Split({self.num_users} users, {self.num_items} items, {self.num_train} training "
            f"interactions, {self.num_users} validation, {self.num_users} test)")


def leave_one_out(data: Interactions) -> Split:
  """Splits each user's time-ordered interactions: ``[..train.., valid, test]``.

  >>> from embedlib.data.movielens.interactions import RawRatings, build_interactions
  >>> raw = RawRatings(user=np.array([7, 7, 7, 7]), item=np.array([4, 5, 6, 4]),
  ...                  time=np.array([1.0, 2.0, 3.0, 4.0]), rating=np.full(4, np.nan),
  ...                  titles={}, source="doc")
  >>> split = leave_one_out(build_interactions(raw))
  >>> split.train_items[0], split.valid_item, split.test_item
  (array([1, 2], dtype=int32), array([3], dtype=int32), array([1], dtype=int32))

  Args:
    data: from ``load``: sorted by (user, time), every user with at least
      ``MIN_INTERACTIONS`` interactions.

  Returns:
    The split.
  """
  counts = np.bincount(data.user, minlength=data.num_users)
  if data.num_users == 0 or counts.min() < MIN_INTERACTIONS:
    short = int(np.argmin(counts)) if data.num_users else 0
    raise ValueError(f"user {short} has {counts[short] if data.num_users else 0} interactions; "
                     f"leave-one-out needs at least {MIN_INTERACTIONS} per user. Build the "
                     "interactions with movielens.load, which skips such users.")
  if np.any(np.diff(data.user) < 0):
    raise ValueError("interactions are not sorted by user; build them with movielens.load.")
  ends = np.cumsum(counts)
  test = ends - 1
  valid = ends - 2
  train = np.ones(len(data.user), bool)
  train[test] = False
  train[valid] = False
  offsets = np.concatenate([[0], np.cumsum(counts - 2)])
  return Split(
      num_users=data.num_users,
      num_items=data.num_items,
      item_titles=data.item_titles,
      train_items=Ragged(data.item[train], offsets),
      train_times=Ragged(data.time[train], offsets),
      valid_item=data.item[valid],
      valid_time=data.time[valid],
      test_item=data.item[test],
      test_time=data.time[test],
      train_ratings=Ragged(data.rating[train], offsets),
      valid_rating=data.rating[valid],
      test_rating=data.rating[test],
      raw_user_ids=data.raw_user_ids,
      raw_item_ids=data.raw_item_ids,
  )
