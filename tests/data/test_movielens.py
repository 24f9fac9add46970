"""embedlib.data.movielens: every format's reader on tiny files, remap, time order, split, bad input."""

import logging

import numpy as np
import pytest

from embedlib.data import movielens
from embedlib.data.movielens import MovieLensFormatError

# (user, item, rating, timestamp) in file order. User 5 has two ratings and is skipped;
# user 9's first two share a timestamp (file order decides), and its item 30 is titled.
ROWS = [
    (9, 30, 4.0, 500), (7, 10, 3.0, 300), (9, 20, 5.0, 500), (7, 20, 1.0, 100),
    (5, 40, 2.0, 50), (7, 30, 4.5, 200), (9, 10, 2.0, 400), (5, 10, 3.0, 60),
    (7, 50, 4.0, 400),
]
TITLES = {10: "Toy Story (1995)", 20: "Café, Paris (1999)", 30: "Heat (1995)", 50: "Fargo (1996)"}


def write_100k(folder):
  folder.mkdir()
  (folder / "u.data").write_text("".join(f"{u}\t{i}\t{int(r)}\t{t}\n" for u, i, r, t in ROWS))
  (folder / "u.item").write_bytes("".join(
      f"{i}|{t}|01-Jan-1995||http://x|" + "|".join("0" * 19) + "\n"
      for i, t in TITLES.items()).encode("latin-1"))
  (folder / "u.user").write_text("5|24|M|technician|85711\n")


def write_1m(folder):
  folder.mkdir()
  (folder / "ratings.dat").write_text("".join(f"{u}::{i}::{int(r)}::{t}\n" for u, i, r, t in ROWS))
  (folder / "movies.dat").write_bytes("".join(
      f"{i}::{t}::Comedy\n" for i, t in TITLES.items()).encode("latin-1"))
  (folder / "users.dat").write_text("5::M::25::7::55117\n")


def write_20m(folder):
  folder.mkdir()
  (folder / "ratings.csv").write_text(
      "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in ROWS))
  (folder / "movies.csv").write_text("movieId,title,genres\n" + "".join(
      f'{i},"{t}",Comedy\n' if "," in t else f"{i},{t},Comedy\n" for i, t in TITLES.items()),
      encoding="utf-8")


def write_atomic(folder):
  folder.mkdir()
  (folder / f"{folder.name}.inter").write_text(
      "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
      + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ROWS))
  (folder / f"{folder.name}.item").write_text(
      "item_id:token\tmovie_title:token_seq\tclass:token_seq\n"
      + "".join(f"{i}\t{t}\tComedy\n" for i, t in TITLES.items()), encoding="utf-8")
  (folder / f"{folder.name}.user").write_text("user_id:token\tage:token\n5\t24\n")


WRITERS = {"ml-100k": write_100k, "ml-1m": write_1m, "ml-20m": write_20m, "atomic": write_atomic}


@pytest.mark.parametrize("fmt", WRITERS)
def test_each_format_reads_the_same_interactions(tmp_path, fmt, caplog):
  WRITERS[fmt](tmp_path / fmt)
  with caplog.at_level(logging.WARNING):
    data = movielens.load(tmp_path / fmt, time_order="exact")
  # Users by first appearance among kept rows (9, 7), items likewise (30, 10, 20, 50).
  assert data.raw_user_ids.tolist() == (["9", "7"] if fmt == "atomic" else [9, 7])
  raw_items = [30, 10, 20, 50]
  assert data.raw_item_ids.tolist() == (["[PAD]"] + [str(i) for i in raw_items] if fmt == "atomic"
                                        else [-1] + raw_items)
  assert data.user.tolist() == [0, 0, 0, 1, 1, 1, 1]
  # User 9: 400 (item 10), then the tie at 500 in file order (30, then 20).
  # User 7: 100 (20), 200 (30), 300 (10), 400 (50).
  assert data.item.tolist() == [2, 1, 3, 3, 1, 2, 4]
  assert data.time.tolist() == [400, 500, 500, 100, 200, 300, 400]
  expected_ratings = [2.0, 4.0, 5.0, 1.0, 4 if fmt in ("ml-100k", "ml-1m") else 4.5, 3.0, 4.0]
  assert data.rating.tolist() == expected_ratings
  assert data.item.dtype == np.int32 and data.user.dtype == np.int32 and data.time.dtype == np.int64
  assert (data.num_users, data.num_items, data.skipped_users, data.skipped_interactions) == (2, 4, 1, 2)
  assert "skipped 1 user(s) with fewer than 3" in caplog.text
  want_titles = {1: "Heat (1995)", 2: "Toy Story (1995)", 3: "Café, Paris (1999)", 4: "Fargo (1996)"}
  assert data.item_titles == want_titles
  # The ratings file itself is accepted as the path, and reading is deterministic.
  again = movielens.load(data.source, time_order="exact")
  assert again.item.tolist() == data.item.tolist() and again.item_titles == want_titles


def test_leave_one_out_split(tmp_path):
  write_1m(tmp_path / "ml")
  split = movielens.leave_one_out(movielens.load(tmp_path / "ml", time_order="exact"))
  assert (split.num_users, split.num_items, split.num_train) == (2, 4, 3)
  assert [t.tolist() for t in split.train_items] == [[2], [3, 1]]
  assert [t.tolist() for t in split.train_times] == [[400], [100, 200]]
  assert split.valid_item.tolist() == [1, 2] and split.valid_time.tolist() == [500, 300]
  assert split.test_item.tolist() == [3, 4] and split.test_time.tolist() == [500, 400]
  assert split.train_items[1].dtype == np.int32 and split.item_titles[4] == "Fargo (1996)"
  # The ratings travel with the items (the ranker's actions).
  assert [r.tolist() for r in split.train_ratings] == [[2.0], [1.0, 4.0]]
  assert split.valid_rating.tolist() == [4.0, 3.0] and split.test_rating.tolist() == [5.0, 4.0]


def test_recbole_time_order_ties_close_times_in_file_order(tmp_path):
  # Min-max scaled to float32, 999_999_990 and 999_999_999 are one value: RecBole keeps
  # them in file order (item 2 before item 1); the exact order is by the seconds.
  folder = tmp_path / "ml"
  folder.mkdir()
  (folder / "u.data").write_text("1\t9\t1\t0\n1\t2\t1\t999999999\n1\t1\t1\t999999990\n")
  recbole = movielens.load(folder)
  exact = movielens.load(folder, time_order="exact")
  assert recbole.raw_item_ids[recbole.item].tolist() == [9, 2, 1]
  assert exact.raw_item_ids[exact.item].tolist() == [9, 1, 2]
  with pytest.raises(ValueError, match="'recbole' orders as RecBole"):
    movielens.load(folder, time_order="seconds")


def test_fast_and_line_by_line_parsers_agree(tmp_path):
  # A blank line sends the file through the line-by-line parser.
  write_1m(tmp_path / "a")
  write_1m(tmp_path / "b")
  path = tmp_path / "b" / "ratings.dat"
  path.write_text(path.read_text().replace("\n", "\n\n", 1))
  a, b = movielens.load(tmp_path / "a"), movielens.load(tmp_path / "b")
  assert a.item.tolist() == b.item.tolist() and a.time.tolist() == b.time.tolist()


@pytest.mark.parametrize("name,text,match", [
    ("ratings.dat", "1::2::3::4\n1::2::3\n", r"ratings\.dat:2: expected 4 fields separated by '::'"),
    ("u.data", "1\t2\t3\t4\n1\t2\t3\t4\n1\tx\t3\t4\n", r"u\.data:3: item id must be an integer, got 'x'"),
    ("u.data", "1\t2\t3\t4\n1\t2.5\t3\t4\n", r"u\.data:2: item id must be an integer, got '2.5'"),
    ("ratings.csv", "user,movie,rating,time\n1,2,3,4\n", r"ratings\.csv:1: expected the header"),
    ("ratings.csv", "userId,movieId,rating,timestamp\n1,2,3,4\n1,2,nan,4\n",
     r"ratings\.csv:3: rating must be finite"),
    ("x.inter", "user_id\titem_id:token\n", r"x\.inter:1: header field 'user_id' is not 'name:type'"),
    ("x.inter", "user_id:token\titem_id:token\n1\t2\n", r"x\.inter:1: no timestamp:float field"),
    ("x.inter", "user_id:token\titem_id:token\ttimestamp:float\n1\t2\t3\n1\t2\n",
     r"x\.inter:3: expected 3 fields"),
])
def test_malformed_line_names_file_and_line(tmp_path, name, text, match):
  (tmp_path / name).write_text(text)
  with pytest.raises(MovieLensFormatError, match=match):
    movielens.load(tmp_path / name)


def test_folder_without_ratings_lists_what_it_looked_for(tmp_path):
  (tmp_path / "ml-1m").mkdir()
  with pytest.raises(MovieLensFormatError, match=r"looked for \*\.inter, ratings\.csv, "
                     r"ratings\.dat, u\.data\. It holds folders ml-1m: give the one"):
    movielens.load(tmp_path)
  with pytest.raises(FileNotFoundError, match="no such file or folder"):
    movielens.load(tmp_path / "missing")


def test_every_user_too_short(tmp_path):
  (tmp_path / "u.data").write_text("1\t2\t3\t4\n1\t3\t3\t5\n")
  with pytest.raises(ValueError, match="every user has fewer than 3"):
    movielens.load(tmp_path)
  with pytest.raises(ValueError, match="at least 3"):
    movielens.load(tmp_path, min_interactions=2)
