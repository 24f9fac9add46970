"""MovieLens requests of the two towers and the ranker: epochs, histories, actions, candidates,
eval rows, resume and process slices, on a small split."""

import numpy as np
import pytest

from embedlib.data.movielens import Ragged, Split
from embedlib.data.movielens_requests import ACTIONS, RankingRequests, RetrievalRequests

S = 3
NUM_ITEMS = 40


def _split(lengths, seed=0):
  """Users with ``lengths`` training ratings of distinct movies, each user's own."""
  rng = np.random.default_rng(seed)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  items, valid, test = [], [], []
  for n in lengths:
    movies = rng.choice(NUM_ITEMS, n + 2, replace=False) + 1
    items.append(movies[:n])
    valid.append(movies[n])
    test.append(movies[n + 1])
  ratings = rng.integers(1, 6, offsets[-1]).astype(np.float32)
  times = np.arange(offsets[-1], dtype=np.int64)
  u = len(lengths)
  return Split(
      num_users=u, num_items=NUM_ITEMS, item_titles={},
      train_items=Ragged(np.concatenate(items).astype(np.int32), offsets),
      train_times=Ragged(times, offsets),
      valid_item=np.array(valid, np.int32), valid_time=np.zeros(u, np.int64),
      test_item=np.array(test, np.int32), test_time=np.zeros(u, np.int64),
      train_ratings=Ragged(ratings, offsets),
      valid_rating=rng.integers(1, 6, u).astype(np.float32),
      test_rating=rng.integers(1, 6, u).astype(np.float32))


SPLIT = _split([1, 2, 5, 7, 4])  # 0 + 1 + 4 + 6 + 3 = 14 training requests an epoch


def _actions(ratings):
  return [[1.0, float(r >= 4)] for r in ratings]


def _rows(batch):
  """(user, next movie (split id), history (split ids), history actions) of each row."""
  return [(int(u), int(i) + 1, [int(h) + 1 for h in hist if h >= 0],
           acts[:int((hist >= 0).sum())].tolist())
          for u, i, hist, acts in zip(batch["user"], batch["item"], batch["history_item"],
                                      batch["history_actions"])]


def test_an_epoch_is_every_training_rating_after_each_users_first_once():
  source = RetrievalRequests(SPLIT, history_len=S, batch_size=4, seed=1)
  assert source.requests_per_epoch == 14
  rows = [r for i in range(7) for r in _rows(source.batch(i))]  # 28 rows: two epochs
  want = []
  for u in range(SPLIT.num_users):
    items, ratings = SPLIT.train_items[u], SPLIT.train_ratings[u]
    for t in range(1, len(items)):
      want.append((u, int(items[t]), items[max(0, t - S):t].tolist(),
                   _actions(ratings[max(0, t - S):t])))
  key = lambda r: (r[0], r[1])
  assert sorted(rows[:14], key=key) == sorted(want, key=key)
  assert sorted(rows[14:], key=key) == sorted(want, key=key)
  assert [key(r) for r in rows[:14]] != [key(r) for r in rows[14:]]  # reshuffled per epoch
  batch = source.batch(0)
  assert batch["history_author"].tolist() == np.where(batch["history_item"] >= 0, 0, -1).tolist()
  assert (batch["author"] == 0).all() and source.catalogue().tolist() == [0] * NUM_ITEMS


def test_eval_rows_hold_the_history_before_the_held_out_movie():
  valid = RetrievalRequests(SPLIT, history_len=S, batch_size=3, kind="valid", exclude_seen=True)
  test = RetrievalRequests(SPLIT, history_len=S, batch_size=3, kind="test", exclude_seen=True)
  assert len(valid) == len(test) == 2
  vrows = [r for b in valid for r in _rows(b)]
  trows = [r for b in test for r in _rows(b)]
  for u in range(SPLIT.num_users):
    items, ratings = SPLIT.train_items[u], SPLIT.train_ratings[u]
    assert vrows[u] == (u, SPLIT.valid_item[u], items[-S:].tolist(), _actions(ratings[-S:]))
    with_valid = np.append(items, SPLIT.valid_item[u])[-S:].tolist()
    assert trows[u][:3] == (u, SPLIT.test_item[u], with_valid)
    assert trows[u][3][-1] == _actions([SPLIT.valid_rating[u]])[0]
  last = test.batch(1)
  assert last["weight"].tolist() == [1.0, 1.0, 0.0]
  excluded = last["exclude"][0]
  assert sorted(excluded[excluded > 0]) == sorted(np.append(SPLIT.train_items[3],
                                                            SPLIT.valid_item[3]))


def test_position_resumes_and_processes_split_each_batch():
  one = RetrievalRequests(SPLIT, history_len=S, batch_size=4, seed=2)
  batches = [next(one) for _ in range(5)]
  one.set_state({"position": 3})
  resumed = next(one)
  assert all((resumed[k] == batches[3][k]).all() for k in batches[3])
  halves = [RetrievalRequests(SPLIT, history_len=S, batch_size=4, seed=2, process_index=p,
                              process_count=2) for p in (0, 1)]
  for index in (0, 4):
    parts = [h.batch(index) for h in halves]
    for k, v in batches[index].items():
      assert (np.concatenate([p[k] for p in parts]) == v).all(), k


@pytest.mark.parametrize("kind", ["train", "valid", "test"])
def test_ranking_candidates_are_the_rated_movie_and_unrated_ones(kind):
  source = RankingRequests(SPLIT, history_len=S, batch_size=4, kind=kind, num_candidates=6,
                           seed=5)
  batches = [source.batch(i) for i in range(4 if kind == "train" else 2)]
  slots = []
  for index, batch in enumerate(batches):
    rows = _rows(dict(batch, item=np.zeros(len(batch["user"]), np.int32)))
    for row, (u, _, history, _) in enumerate(rows):
      candidates, labels = batch["candidate_item"][row] + 1, batch["labels"][row]
      if kind != "train" and index * 4 + row >= SPLIT.num_users:  # padding rows
        assert (candidates == 0).all() and not labels.any()
        continue
      rated = labels[:, 0] == 1
      assert rated.sum() == 1
      slots.append(int(np.flatnonzero(rated)[0]))
      movie = candidates[rated][0]
      if kind == "train":
        t = history and np.flatnonzero(SPLIT.train_items[u] == movie)[0]
        assert SPLIT.train_items[u][max(0, t - S):t].tolist() == history
        rating = SPLIT.train_ratings[u][t]
        not_rated = set(SPLIT.train_items[u].tolist())
      else:
        held = SPLIT.valid_item if kind == "valid" else SPLIT.test_item
        assert movie == held[u]
        rating = (SPLIT.valid_rating if kind == "valid" else SPLIT.test_rating)[u]
        not_rated = set(SPLIT.train_items[u].tolist()) | {SPLIT.valid_item[u], SPLIT.test_item[u]}
      assert labels[rated][0].tolist() == _actions([rating])[0]
      others = candidates[~rated]
      assert not labels[~rated].any() and not set(others.tolist()) & not_rated
      assert ((others >= 1) & (others <= NUM_ITEMS)).all()
  assert len(set(slots)) > 1  # the rated movie's slot varies
  again = RankingRequests(SPLIT, history_len=S, batch_size=4, kind=kind, num_candidates=6, seed=5)
  assert (again.batch(1)["candidate_item"] == batches[1]["candidate_item"]).all()


def test_bad_input_names_the_fix():
  with pytest.raises(ValueError, match="give at least 2"):
    RankingRequests(SPLIT, history_len=S, batch_size=4, num_candidates=1)
  with pytest.raises(ValueError, match="too many to draw 39 unrated"):
    RankingRequests(SPLIT, history_len=S, batch_size=4, num_candidates=40)
  no_ratings = _split([3, 4])
  object.__setattr__(no_ratings, "train_ratings",
                     Ragged(np.full(7, np.nan, np.float32), no_ratings.train_ratings.offsets))
  with pytest.raises(ValueError, match="holds no ratings, so no movie is 'liked'"):
    RankingRequests(no_ratings, history_len=S, batch_size=4, num_candidates=3)
  RetrievalRequests(no_ratings, history_len=S, batch_size=4)  # the two towers need none
  with pytest.raises(ValueError, match="history_len must be >= 1"):
    RetrievalRequests(SPLIT, history_len=0, batch_size=4)
  assert ACTIONS == ("rated", "liked")
