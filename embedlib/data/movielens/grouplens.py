"""The GroupLens releases as downloaded: ML-100K ``u.data`` / ``u.item``, ML-1M and
ML-10M ``ratings.dat`` / ``movies.dat``, ML-20M, 25M and 32M ``ratings.csv`` / ``movies.csv``.

Every ratings file holds user id, item id, rating and a Unix timestamp per
line; only the separator and a CSV header differ. The user files
(``u.user``, ``users.dat``) hold demographics, which nothing here uses.
"""

from __future__ import annotations

import csv
import io

import numpy as np

from embedlib.data.movielens import formats
from embedlib.data.movielens.formats import Layout, MovieLensFormatError
from embedlib.data.movielens.interactions import RawRatings

_CSV_HEADER = ["userId", "movieId", "rating", "timestamp"]
_NAMES = ("user id", "item id", "rating", "timestamp")


def read_ratings(layout: Layout, path: str, items_path: str | None) -> RawRatings:
  """Reads a GroupLens ratings file and, when present beside it, its titles."""
  with open(path, "rb") as f:
    text = formats.decode(f.read())
  skip = 0
  if layout.ratings.endswith(".csv"):
    header = text.split("\n", 1)[0].strip().split(",")
    if header != _CSV_HEADER:
      raise MovieLensFormatError(f"{path}:1: expected the header {','.join(_CSV_HEADER)}, "
                                 f"found {','.join(header)!r}.")
    skip = 1
  table = formats.numeric_table(text, layout.separator, 4, skip)
  if table is None:
    table = _parse_lines(layout, path, text, skip)
  _check_ids(layout, path, text, skip, table)
  titles = read_titles(layout, items_path) if items_path else {}
  return RawRatings(user=table[:, 0].astype(np.int64), item=table[:, 1].astype(np.int64),
                    time=table[:, 3].copy(), rating=table[:, 2].astype(np.float32),
                    titles=titles, source=path)


def _parse_lines(layout: Layout, path: str, text: str, skip: int) -> np.ndarray:
  rows = []
  for number, line in formats.lines(text, skip):
    fields = formats.fields_of(path, number, line.strip(), layout.separator, 4, layout.fields)
    rows.append([formats.number(path, number, value, name, integer=name != "rating")
                 for value, name in zip(fields, _NAMES)])
  if not rows:
    raise MovieLensFormatError(f"{path}: no ratings in the file.")
  return np.asarray(rows, np.float64)


def _check_ids(layout: Layout, path: str, text: str, skip: int, table: np.ndarray) -> None:
  """The C parser accepts ``1.5`` or ``1e3`` as an id; find the line and say so."""
  bad = np.flatnonzero(np.any(table[:, [0, 1, 3]] != np.round(table[:, [0, 1, 3]]), axis=1))
  if len(bad):
    _parse_lines(layout, path, text, skip)  # raises at the first such line
    raise MovieLensFormatError(f"{path}: row {bad[0] + 1} has an id or timestamp that "
                               "is not an integer.")


def read_titles(layout: Layout, path: str) -> dict[int, str]:
  """Raw item id -> title from ``u.item``, ``movies.dat`` or ``movies.csv``."""
  with open(path, "rb") as f:
    text = formats.decode(f.read())
  titles = {}
  if path.endswith(".csv"):
    rows = csv.reader(io.StringIO(text))
    header = next(rows, None)
    if header is None or header[:2] != ["movieId", "title"]:
      raise MovieLensFormatError(f"{path}:1: expected the header movieId,title,genres, "
                                 f"found {header!r}.")
    for number, row in enumerate(rows, start=2):
      if not row:
        continue
      if len(row) < 2:
        raise MovieLensFormatError(f"{path}:{number}: expected movieId,title,genres, found {row!r}")
      titles[int(formats.number(path, number, row[0], "movieId", integer=True))] = row[1]
    return titles
  separator, count = ("|", 24) if layout.name == "ml-100k" else ("::", 3)
  what = "movie id|title|release date|...|19 genre flags" if separator == "|" else \
      "MovieID::Title::Genres"
  for number, line in formats.lines(text):
    fields = formats.fields_of(path, number, line.rstrip("\r\n"), separator, count, what)
    titles[int(formats.number(path, number, fields[0], "movie id", integer=True))] = fields[1]
  return titles
