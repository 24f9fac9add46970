"""Raw rows to ``Interactions``: skip short users, remap ids densely, order each user by time."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

log = logging.getLogger(__name__)

#: Leave-one-out needs a test, a validation and at least one training interaction.
MIN_INTERACTIONS = 3
#: ``time_order`` values: see ``load``.
TIME_ORDERS = ("recbole", "exact")


@dataclasses.dataclass(frozen=True)
class RawRatings:
  """Columns as a reader found them, one row per line of the ratings file, in file order.

  Attributes:
    user: ``[N]`` raw user ids (int64, or str for RecBole's token columns).
    item: ``[N]`` raw item ids, same kinds.
    time: ``[N]`` float64 timestamps in seconds.
    rating: ``[N]`` float32, NaN where the file has no rating.
    titles: raw item id -> title, where the release has titles.
    source: the file the rows came from.
  """

  user: np.ndarray
  item: np.ndarray
  time: np.ndarray
  rating: np.ndarray
  titles: dict
  source: str


@dataclasses.dataclass(frozen=True, eq=False)
class Interactions:
  """Every kept interaction, sorted by (user, time, file order).

  Attributes:
    user: ``[N]`` int32 dense user ids ``0 .. num_users - 1``.
    item: ``[N]`` int32 dense item ids ``1 .. num_items`` (0 is padding, never an item).
    time: ``[N]`` int64 seconds (floored where a file gives fractions).
    rating: ``[N]`` float32, NaN where the file has no rating.
    num_users: ``U``.
    num_items: ``I``.
    item_titles: dense item id -> title, for the items whose release names them.
    raw_user_ids: ``[U]`` the file's id of each dense user.
    raw_item_ids: ``[I + 1]`` the file's id of each dense item; entry 0 (padding)
      is -1 for numeric ids and ``"[PAD]"`` for string ids (RecBole's token).
    skipped_users: users left out for having fewer than ``MIN_INTERACTIONS``.
    skipped_interactions: their interactions.
    source: the ratings file read.
  """

  user: np.ndarray
  item: np.ndarray
  time: np.ndarray
  rating: np.ndarray
  num_users: int
  num_items: int
  item_titles: dict
  raw_user_ids: np.ndarray
  raw_item_ids: np.ndarray
  skipped_users: int = 0
  skipped_interactions: int = 0
  source: str = ""

  def __len__(self) -> int:
    return len(self.user)

  def __repr__(self) -> str:
    return (f"Interactions({len(self)} interactions, {self.num_users} users, "
            f"{self.num_items} items, skipped_users={self.skipped_users}, source={self.source!r})")


def first_appearance_ids(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Dense ids numbered by first appearance, as ``pandas.factorize`` (RecBole's remap) does.

  >>> first_appearance_ids(np.array([30, 10, 30, 20]))
  (array([0, 1, 0, 2]), array([30, 10, 20]))

  Args:
    raw: ``[N]`` raw ids.

  Returns:
    ``(dense [N] starting at 0, uniques [K] with uniques[dense] == raw)``.
  """
  uniques, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
  order = np.argsort(first, kind="stable")
  rank = np.empty(len(uniques), np.int64)
  rank[order] = np.arange(len(uniques))
  return rank[inverse.reshape(-1)], uniques[order]


def sort_key(time: np.ndarray, time_order: str) -> np.ndarray:
  """The timestamps the per-user sort compares.

  ``"recbole"``: min-max normalised and cast to float32, as RecBole's ML-100K
  config (``normalize_all``) leaves them before its stable sort, so times a
  second or so apart can tie and keep file order. ``"exact"``: the seconds.
  """
  if time_order == "exact":
    return time
  if time_order != "recbole":
    raise ValueError(f"time_order={time_order!r} is not one of {TIME_ORDERS}; "
                     "'recbole' orders as RecBole does, 'exact' by the seconds.")
  if len(time) == 0:
    return time.astype(np.float32)
  lo, hi = time.min(), time.max()
  if hi == lo:  # RecBole sets a constant column to 1.0: every row ties.
    return np.ones(len(time), np.float32)
  return ((time - lo) / (hi - lo)).astype(np.float32)


def build_interactions(raw: RawRatings, *, time_order: str = "recbole",
                       min_interactions: int = MIN_INTERACTIONS) -> Interactions:
  """Skips users with fewer than ``min_interactions``, remaps, sorts.

  Users and items are numbered in order of first appearance in the file
  (after skipping), users from 0 and items from 1. Each user's interactions
  are sorted by ``sort_key(time, time_order)``; ties keep file order.
  """
  if min_interactions < MIN_INTERACTIONS:
    raise ValueError(f"min_interactions={min_interactions}: leave-one-out needs at least "
                     f"{MIN_INTERACTIONS} per user (test, validation, one to train on).")
  n = len(raw.user)
  if n == 0:
    raise ValueError(f"{raw.source}: no interactions in the file.")
  user_dense, _ = first_appearance_ids(raw.user)
  counts = np.bincount(user_dense)
  keep = counts[user_dense] >= min_interactions
  skipped_users = int((counts < min_interactions).sum())
  skipped_interactions = int(n - keep.sum())
  if skipped_users:
    log.warning("%s: skipped %d user(s) with fewer than %d interactions (%d interactions).",
                raw.source, skipped_users, min_interactions, skipped_interactions)
  if not keep.any():
    raise ValueError(f"{raw.source}: every user has fewer than {min_interactions} "
                     "interactions; leave-one-out has nothing to split.")
  users, raw_users = first_appearance_ids(raw.user[keep])
  items, raw_items = first_appearance_ids(raw.item[keep])
  items = items + 1
  time = raw.time[keep]
  # Scaled over every row, skipped users' too, as RecBole (which keeps them) scales.
  key = sort_key(raw.time, time_order)[keep]
  order = np.lexsort((np.arange(len(users)), key, users))
  pad = np.array(["[PAD]"]) if raw_items.dtype.kind in "US" else np.array([-1])
  raw_item_ids = np.concatenate([pad, raw_items])
  dense_of = {r: i for i, r in enumerate(raw_item_ids.tolist()) if i}
  titles = {dense_of[r]: t for r, t in raw.titles.items() if r in dense_of}
  return Interactions(
      user=users[order].astype(np.int32),
      item=items[order].astype(np.int32),
      time=np.floor(time[order]).astype(np.int64),
      rating=raw.rating[keep][order].astype(np.float32),
      num_users=len(raw_users),
      num_items=len(raw_items),
      item_titles=titles,
      raw_user_ids=raw_users,
      raw_item_ids=raw_item_ids,
      skipped_users=skipped_users,
      skipped_interactions=skipped_interactions,
      source=raw.source,
  )
