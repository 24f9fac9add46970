"""RecBole's atomic files: ``<dataset>.inter`` and ``<dataset>.item``, tab-separated,
with a typed header (``user_id:token  item_id:token  rating:float  timestamp:float``).

Ids stay strings, as RecBole's ``token`` columns are (``"07"`` and ``"7"``
are two users). Field names are RecBole's defaults (``USER_ID_FIELD``
``user_id``, ``ITEM_ID_FIELD`` ``item_id``, ``TIME_FIELD`` ``timestamp``,
``RATING_FIELD`` ``rating``); the title is the item file's first field whose
name contains ``title``. Other columns (and ``.user`` files) are not read.
"""

from __future__ import annotations

import numpy as np

from embedlib.data.movielens import formats
from embedlib.data.movielens.formats import Layout, MovieLensFormatError
from embedlib.data.movielens.interactions import RawRatings

_TYPES = ("token", "token_seq", "float", "float_seq")


def _header(path: str, text: str) -> list[tuple[str, str]]:
  first = text.split("\n", 1)[0].rstrip("\r")
  columns = []
  for field in first.split("\t"):
    name, colon, kind = field.partition(":")
    if not colon or kind not in _TYPES:
      raise MovieLensFormatError(
          f"{path}:1: header field {field!r} is not 'name:type' with type one of {_TYPES} "
          "(RecBole's atomic header, e.g. 'user_id:token').")
    columns.append((name, kind))
  return columns


def _column(path: str, columns: list[tuple[str, str]], name: str, kind: str,
            required: bool = True) -> int | None:
  for i, (have, have_kind) in enumerate(columns):
    if have == name:
      if have_kind != kind:
        raise MovieLensFormatError(f"{path}:1: field {name!r} is typed {have_kind!r}; "
                                   f"RecBole's {name} is {kind!r}.")
      return i
  if required:
    header = "\t".join(f"{n}:{k}" for n, k in columns)
    raise MovieLensFormatError(f"{path}:1: no {name}:{kind} field in the header {header!r}; "
                               "a sequential split needs user_id, item_id and timestamp.")
  return None


def read_ratings(layout: Layout, path: str, items_path: str | None) -> RawRatings:
  """Reads ``<dataset>.inter`` and, when present beside it, titles from ``<dataset>.item``."""
  with open(path, "rb") as f:
    text = formats.decode(f.read())
  columns = _header(path, text)
  iu = _column(path, columns, "user_id", "token")
  ii = _column(path, columns, "item_id", "token")
  it = _column(path, columns, "timestamp", "float")
  ir = _column(path, columns, "rating", "float", required=False)
  what = "\\t".join(n for n, _ in columns)
  users, items, times, ratings = [], [], [], []
  for number, line in formats.lines(text, skip=1):
    fields = formats.fields_of(path, number, line.rstrip("\r\n"), "\t", len(columns), what)
    if not fields[iu] or not fields[ii]:
      raise MovieLensFormatError(f"{path}:{number}: empty user_id or item_id: {line[:120]!r}")
    users.append(fields[iu])
    items.append(fields[ii])
    times.append(formats.number(path, number, fields[it], "timestamp", integer=False))
    ratings.append(np.nan if ir is None else
                   formats.number(path, number, fields[ir], "rating", integer=False))
  if not users:
    raise MovieLensFormatError(f"{path}: no interactions after the header.")
  titles = read_titles(items_path) if items_path else {}
  return RawRatings(user=np.asarray(users), item=np.asarray(items),
                    time=np.asarray(times, np.float64), rating=np.asarray(ratings, np.float32),
                    titles=titles, source=path)


def read_titles(path: str) -> dict[str, str]:
  """Raw item id -> title from a ``.item`` file; empty if it has no title field."""
  with open(path, "rb") as f:
    text = formats.decode(f.read())
  columns = _header(path, text)
  ii = _column(path, columns, "item_id", "token")
  it = next((i for i, (name, _) in enumerate(columns) if "title" in name), None)
  if it is None:
    return {}
  what = "\\t".join(n for n, _ in columns)
  titles = {}
  for number, line in formats.lines(text, skip=1):
    fields = formats.fields_of(path, number, line.rstrip("\r\n"), "\t", len(columns), what)
    titles[fields[ii]] = fields[it]
  return titles
