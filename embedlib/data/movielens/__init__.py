"""MovieLens as downloaded, and RecBole's atomic files, to a leave-one-out split.

    from embedlib.data import movielens
    data = movielens.load(path)           # a file or a folder; the format is detected
    split = movielens.leave_one_out(data)

``load`` reads the GroupLens releases as they unzip (ML-100K ``u.data`` and
``u.item``; ML-1M and ML-10M ``ratings.dat`` and ``movies.dat``; ML-20M,
25M and 32M ``ratings.csv`` and ``movies.csv``) and RecBole's atomic files
(``<dataset>.inter`` and ``<dataset>.item``). It returns ``Interactions``:
dense ids (users ``0 .. U-1``, items ``1 .. I``, 0 being padding), sorted by
user, then time, then file order. ``leave_one_out`` makes each user's last
interaction the test target, the one before it validation, and the rest
training.

Matched with RecBole 1.2.1 (``data/dataset/dataset.py``,
``sequential_dataset.py``), so that a split here is RecBole's split:

* Every line is an interaction: no rating threshold, duplicates kept
  (RecBole's ``rm_dup_inter`` is off by default).
* Ids are numbered in order of first appearance in the ratings file, as
  RecBole's ``pandas.factorize`` remap does: users from 0 here (RecBole
  reserves 0 for padding users too, so its user ``u + 1`` is user ``u``
  here), items from 1 in both.
* Order within a user: a stable sort by timestamp from file order. With
  ``time_order="recbole"`` (the default) the timestamps compared are the ones
  RecBole's ML-100K config leaves after ``normalize_all``: min-max scaled and
  stored as float32, so times a second or so apart can tie, and tied rows
  keep file order. ``time_order="exact"`` compares the seconds.
* The split is RecBole's ``{'LS': 'valid_and_test'}`` with ``order: TO``: a
  user's last interaction tests, the second-to-last validates.

Where it differs:

* Users with fewer than 3 interactions are skipped (counted in
  ``Interactions.skipped_users`` and logged); RecBole keeps them, putting a
  two-interaction user's last one in test and nothing in validation. No
  ML release has such users (each rater has at least 20 ratings).
* Ids are numbered after skipping, and items that appear only in an item
  file get no id (RecBole numbers them after the rated ones and ranks them
  in full-ranking evaluation). Neither happens with ML-100K's atomic files.
* Without ``normalize_all`` (every RecBole dataset config but ML-100K's),
  RecBole casts raw seconds to float32 (a resolution of about a minute for
  present-day times) before sorting; that coarser order isn't reproduced.
* The GroupLens files are read directly; RecBole reads only atomic files
  (its conversion scripts turn a release into them).

Reading is deterministic. A malformed line raises ``MovieLensFormatError``
naming the file and the line; a folder without a recognised file raises
naming what was looked for.
"""

from __future__ import annotations

import os

from embedlib.data.movielens import atomic, formats, grouplens
from embedlib.data.movielens.formats import LAYOUTS, MovieLensFormatError
from embedlib.data.movielens.interactions import (
    MIN_INTERACTIONS,
    TIME_ORDERS,
    Interactions,
    RawRatings,
    build_interactions,
    first_appearance_ids,
)
from embedlib.data.movielens.split import Ragged, Split, leave_one_out


def read_raw(path: str | os.PathLike) -> RawRatings:
  """The ratings file's rows in file order, raw ids, and titles where present.

  Args:
    path: a release's folder, or its ratings file (``u.data``,
      ``ratings.dat``, ``ratings.csv`` or ``<dataset>.inter``).

  Returns:
    ``RawRatings``.
  """
  layout, ratings, items = formats.find(path)
  reader = atomic if layout.name == "recbole" else grouplens
  return reader.read_ratings(layout, ratings, items)


def load(path: str | os.PathLike, *, time_order: str = "recbole",
         min_interactions: int = MIN_INTERACTIONS) -> Interactions:
  """Reads a MovieLens release or RecBole atomic files into ``Interactions``.

  >>> import pathlib, tempfile
  >>> folder = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (folder / "ratings.dat").write_text(
  ...     "1::10::5::100\\n1::20::3::50\\n1::30::4::200\\n2::10::1::10\\n")
  >>> data = load(folder)                       # user 2 has too few ratings
  >>> data.item.tolist(), data.skipped_users, data.raw_item_ids.tolist()
  ([2, 1, 3], 1, [-1, 10, 20, 30])

  Args:
    path: a release's folder, or its ratings file.
    time_order: ``"recbole"`` orders each user's interactions as RecBole
      does for ML-100K (timestamps min-max scaled to float32, ties in file
      order); ``"exact"`` by the seconds, ties in file order.
    min_interactions: users with fewer are skipped (at least 3).

  Returns:
    ``Interactions`` sorted by (user, time, file order).
  """
  return build_interactions(read_raw(path), time_order=time_order,
                            min_interactions=min_interactions)


__all__ = [
    "LAYOUTS",
    "MIN_INTERACTIONS",
    "TIME_ORDERS",
    "Interactions",
    "MovieLensFormatError",
    "RawRatings",
    "Ragged",
    "Split",
    "build_interactions",
    "first_appearance_ids",
    "leave_one_out",
    "load",
    "read_raw",
]
