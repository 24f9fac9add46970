"""Which release a path holds, and the line parsing every reader shares."""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np


class MovieLensFormatError(ValueError):
  """A MovieLens or RecBole file that can't be read: names the file, the line and the rule."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """One release's files: ``ratings`` holds the interactions, ``items`` the titles."""

  name: str
  ratings: str          # a file name, or a suffix for RecBole's "<dataset>.inter"
  items: str | None
  separator: str
  fields: str           # the ratings line, for error messages


#: What ``find`` looks for in a folder, in this order.
LAYOUTS = (
    Layout("recbole", ".inter", ".item", "\t", "typed header, e.g. user_id:token item_id:token "
           "rating:float timestamp:float"),
    Layout("ml-20m", "ratings.csv", "movies.csv", ",", "userId,movieId,rating,timestamp"),
    Layout("ml-1m", "ratings.dat", "movies.dat", "::", "UserID::MovieID::Rating::Timestamp"),
    Layout("ml-100k", "u.data", "u.item", "\t", "user id \\t item id \\t rating \\t timestamp"),
)


def _looked_for() -> str:
  return ", ".join(("*" if l.ratings.startswith(".") else "") + l.ratings for l in LAYOUTS)


def _layout_of_file(path: str) -> Layout | None:
  name = os.path.basename(path)
  for layout in LAYOUTS:
    if name == layout.ratings or (layout.ratings.startswith(".") and name.endswith(layout.ratings)):
      return layout
  return None


def find(path: str) -> tuple[Layout, str, str | None]:
  """``(layout, ratings file, items file or None)`` for a file or a folder.

  A folder is searched for the files of ``LAYOUTS`` in order; in a folder
  of RecBole atomic files, ``<folder name>.inter`` wins over other
  ``.inter`` files (RecBole's own choice), and a lone ``.inter`` is taken.
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no such file or folder; give a MovieLens release's "
                            f"folder or its ratings file ({_looked_for()}).")
  if os.path.isfile(path):
    layout = _layout_of_file(path)
    if layout is None:
      raise MovieLensFormatError(f"{path}: not a ratings file this reader knows; it reads "
                                 f"{_looked_for()} (or give their folder).")
    return layout, path, _items_beside(layout, path)
  names = sorted(os.listdir(path))
  for layout in LAYOUTS:
    if layout.ratings.startswith("."):
      inter = [n for n in names if n.endswith(layout.ratings)]
      own = os.path.basename(os.path.normpath(path)) + layout.ratings
      if own in inter:
        inter = [own]
      if len(inter) > 1:
        raise MovieLensFormatError(f"{path}: several RecBole interaction files ({', '.join(inter)}) "
                                   f"and none named {own}; give the file to read.")
      if inter:
        ratings = os.path.join(path, inter[0])
        return layout, ratings, _items_beside(layout, ratings)
    elif layout.ratings in names:
      ratings = os.path.join(path, layout.ratings)
      return layout, ratings, _items_beside(layout, ratings)
  folders = [n for n in names if os.path.isdir(os.path.join(path, n))]
  hint = f" It holds folders {', '.join(folders)}: give the one with the release." if folders else ""
  raise MovieLensFormatError(f"{path}: no MovieLens or RecBole ratings file; looked for "
                             f"{_looked_for()}.{hint}")


def _items_beside(layout: Layout, ratings: str) -> str | None:
  if layout.items is None:
    return None
  if layout.ratings.startswith("."):
    items = ratings[: -len(layout.ratings)] + layout.items
  else:
    items = os.path.join(os.path.dirname(ratings), layout.items)
  return items if os.path.isfile(items) else None


def decode(data: bytes) -> str:
  """UTF-8, or Latin-1 for the older releases' item files (ML-100K, ML-1M) that aren't UTF-8."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return data.decode("latin-1")


def lines(text: str, skip: int = 0):
  """``(1-based line number, line)`` of the non-blank lines after the first ``skip``.

  Split at ``\n`` only: ``str.splitlines`` would also split at characters a
  Latin-1 title may hold (``\x85``), and the line numbers would drift.
  """
  for number, line in enumerate(text.split("\n"), start=1):
    line = line.rstrip("\r")
    if number > skip and line.strip():
      yield number, line


def fields_of(path: str, number: int, line: str, separator: str, count: int, what: str) -> list[str]:
  """Splits one line, or raises naming the file, the line and the expected layout."""
  fields = line.split(separator)
  if len(fields) != count:
    raise MovieLensFormatError(f"{path}:{number}: expected {count} fields separated by "
                               f"{separator!r} ({what}), found {len(fields)}: {line[:120]!r}")
  return fields


def number(path: str, line_number: int, text: str, name: str, *, integer: bool) -> float:
  """One numeric field, or an error naming the file, line and field."""
  try:
    value = int(text) if integer else float(text)
  except ValueError:
    kind = "an integer" if integer else "a number"
    raise MovieLensFormatError(f"{path}:{line_number}: {name} must be {kind}, "
                               f"got {text!r}") from None
  if not integer and not np.isfinite(value):
    raise MovieLensFormatError(f"{path}:{line_number}: {name} must be finite, got {text!r}")
  return value


def numeric_table(text: str, separator: str, columns: int, skip: int = 0) -> np.ndarray | None:
  """All-numeric lines parsed in C: ``[rows, columns]`` float64, or None if
  anything looks off (the caller then parses line by line and names the line).

  A line with the wrong field count is caught by counting separators and
  numbers; a field that isn't a number by numpy stopping early.
  """
  if skip:
    cut = 0
    for _ in range(skip):
      cut = text.find("\n", cut) + 1
      if cut == 0:
        return None
    text = text[cut:]
  if "\n\n" in text or text[:1] == "\n" or "\r" in text:
    return None
  rows = text.count("\n") + (0 if text.endswith("\n") else 1)
  if rows == 0 or text.count(separator) != rows * (columns - 1):
    return None
  spaced = text if separator in (" ", "\t") else text.replace(separator, " ")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    try:
      values = np.fromstring(spaced, dtype=np.float64, sep=" ")
    except (DeprecationWarning, ValueError):
      return None
  if values.size != rows * columns or not np.all(np.isfinite(values)):
    return None
  return values.reshape(rows, columns)
