"""Which files a path names, and the chunks a reader takes them in.

A path is one of:

- a Parquet file (``.parquet``, ``.pq``), a directory holding Parquet files
  (found recursively, in sorted order), or a glob (``logs/day=*/*.parquet``);
- a CSV or TSV file with a header line (``.csv``, ``.tsv``, ``.txt``; a
  ``.tsv`` is tab-separated, any other takes ``delimiter``), or a directory or
  glob of them, every header the same;
- a RecBole atomic ``.inter`` file, typed header (``user_id:token``), with
  the ``.user`` and ``.item`` files of its dataset beside it, when there.

A chunk is a unit a reader loads whole: a Parquet row group, or a byte range
of ``CHUNK_ROWS`` lines of a text file (found by one scan of the file, which
counts its lines). Rows are numbered across all files in order: a row's
number decides its split and its process, the same however it is read.
Text rows are one a line: a quoted field may not hold a line break, and
empty lines end a file (one before a row is an error naming it).
"""

from __future__ import annotations

import dataclasses
import glob as glob_lib
import os

import numpy as np

from embedlib.tabular.schema import SchemaError

PARQUET, CSV, RECBOLE = "parquet", "csv", "recbole"
FORMATS = (PARQUET, CSV, RECBOLE)
#: Lines in a text chunk (a Parquet chunk is a row group, however long).
CHUNK_ROWS = 16_384
_PARQUET_SUFFIXES = (".parquet", ".pq")
_TEXT_SUFFIXES = (".csv", ".tsv", ".txt")
#: The side files of a RecBole dataset, by the entity they describe.
RECBOLE_SIDES = {"user": ".user", "item": ".item"}


class DataError(ValueError):
  """A data file that can't be read as the schema says; names the file, row, column, and the fix."""


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One file's rows from ``first_row`` (numbered across every file), ``rows`` of them.

  Attributes:
    path: the file.
    first_row: the number of its first row across all files.
    rows: rows in the chunk.
    row_group: a Parquet chunk's row group (-1 for text).
    start, stop: a text chunk's byte range (whole lines).
    first_line: a text chunk's first line number in its file (1 is the header).
    file_row: the index of its first row within its file (from 0).
  """

  path: str
  first_row: int
  rows: int
  row_group: int = -1
  start: int = 0
  stop: int = 0
  first_line: int = 0
  file_row: int = 0

  def where(self, i: int) -> str:
    """Where row ``i`` of the chunk is, for an error: ``path:line`` or ``path, row r``."""
    if self.row_group < 0:
      return f"{self.path}:{self.first_line + i}"
    return f"{self.path}, row {self.file_row + i} (row group {self.row_group})"


@dataclasses.dataclass(frozen=True)
class Files:
  """The files of one path, in reading order, and how they are laid out.

  Attributes:
    format: ``parquet``, ``csv`` or ``recbole``.
    paths: the data files (a RecBole dataset's ``.inter`` file).
    delimiter: the text files' field separator.
    header: the text files' column names, as their first line gives them
      (RecBole's ``name:type`` pairs included).
    sides: a RecBole dataset's ``{"user": path, "item": path}``, as present.
  """

  format: str
  paths: tuple[str, ...]
  delimiter: str = ","
  header: tuple[str, ...] = ()
  sides: tuple[tuple[str, str], ...] = ()

  @property
  def side_paths(self) -> dict[str, str]:
    return dict(self.sides)


def _expand(path: str, suffixes: tuple[str, ...]) -> list[str]:
  if os.path.isdir(path):
    found = [os.path.join(d, f) for d, _, names in os.walk(path) for f in names
             if f.endswith(suffixes) and not f.startswith((".", "_"))]
    return sorted(found)
  if any(ch in path for ch in "*?["):
    return sorted(p for p in glob_lib.glob(path, recursive=True) if os.path.isfile(p))
  return [path] if os.path.isfile(path) else []


def detect_format(path: str) -> str:
  """``parquet``, ``csv`` or ``recbole``, from the path's files' suffixes.

  Raises:
    DataError: nothing is there, or no known suffix.
  """
  if path.endswith(".inter"):
    return RECBOLE
  if _expand(path, _PARQUET_SUFFIXES) and (os.path.isdir(path) or path.endswith(
      _PARQUET_SUFFIXES) or any(ch in path for ch in "*?[")):
    found = _expand(path, _PARQUET_SUFFIXES)
    if found and all(p.endswith(_PARQUET_SUFFIXES) for p in found):
      return PARQUET
  if _expand(path, _TEXT_SUFFIXES):
    return CSV
  if os.path.isdir(path):
    inters = _expand(path, (".inter",))
    if len(inters) == 1:
      return RECBOLE
  if not os.path.exists(path) and not any(ch in path for ch in "*?["):
    raise DataError(f"{path} does not exist; pass a Parquet file, a directory or glob of "
                    "them, a CSV / TSV file with a header, or a RecBole .inter file.")
  raise DataError(f"{path} holds no file this reader knows (.parquet / .pq, .csv / .tsv / "
                  ".txt with a header, or a RecBole .inter file); pass one of those, or set "
                  "config.data.format.")


def find(path: str, fmt: str = "auto", delimiter: str = "") -> Files:
  """The ``Files`` a path names (see the module docstring).

  Raises:
    DataError: no file, an empty file, or text files whose headers differ.
  """
  fmt = detect_format(path) if fmt == "auto" else fmt
  if fmt not in FORMATS:
    raise DataError(f"format {fmt!r}; use one of {FORMATS} or 'auto'.")
  if fmt == RECBOLE:
    inter = path
    if os.path.isdir(path):
      found = _expand(path, (".inter",))
      if len(found) != 1:
        raise DataError(f"{path} holds {len(found)} .inter files; pass the one to read.")
      inter = found[0]
    if not os.path.isfile(inter):
      raise DataError(f"{inter} does not exist; pass a RecBole dataset's .inter file.")
    stem = inter[:-len(".inter")]
    sides = tuple((e, stem + s) for e, s in RECBOLE_SIDES.items() if os.path.isfile(stem + s))
    header = read_header(inter, "\t")
    return Files(RECBOLE, (inter,), "\t", header, sides)
  if fmt == PARQUET:
    paths = _expand(path, _PARQUET_SUFFIXES)
    if not paths:
      raise DataError(f"{path} holds no Parquet file (.parquet / .pq); pass a file, a "
                      "directory of them or a glob.")
    return Files(PARQUET, tuple(paths))
  paths = _expand(path, _TEXT_SUFFIXES) or _expand(path, ("",))
  if not paths:
    raise DataError(f"{path}: no CSV / TSV file found; pass a file with a header line.")
  sep = delimiter or ("\t" if paths[0].endswith(".tsv") else ",")
  header = read_header(paths[0], sep)
  for other in paths[1:]:
    names = read_header(other, sep)
    if names != header:
      differ = next((f"no column {n!r}" for n in header if n not in names), None) or next(
          (f"a column {n!r} more" for n in names if n not in header), None) or (
              "the same columns in another order")
      raise DataError(f"{other}: its header differs from {paths[0]}'s ({differ}); every file "
                      "of one path must have the same columns in the same order.")
  return Files(CSV, tuple(paths), sep, header)


def read_header(path: str, delimiter: str) -> tuple[str, ...]:
  """A text file's first line, split at ``delimiter`` (``DataError`` if it is empty)."""
  with open(path, "rb") as f:
    first = f.readline()
  try:  # "-sig": the byte order mark an exported UTF-8 CSV file may begin with is no name
    text = first.decode("utf-8-sig").rstrip("\r\n")
  except UnicodeDecodeError:
    raise DataError(f"{path}:1: the header is not UTF-8 text; pass a CSV / TSV file with a "
                    "header line.") from None
  if not text:
    raise DataError(f"{path} is empty (no header line); a CSV / TSV file needs a first line "
                    "naming its columns.")
  names = tuple(n.strip().strip('"') for n in text.split(delimiter))
  if len(set(names)) != len(names):
    raise DataError(f"{path}:1: the header names a column twice: {names}; give each column "
                    "its own name.")
  return names


def _data_end(f, start: int) -> int:
  """Where a text file's last non-empty line ends (the empty lines after it are no rows)."""
  end = f.seek(0, os.SEEK_END)
  while end > start:
    n = min(end - start, 1 << 16)
    f.seek(end - n)
    block = f.read(n).rstrip(b"\r\n")
    if block:
      return end - n + len(block)
    end -= n
  return start


def text_chunks(path: str, first_row: int) -> list[Chunk]:
  """A text file's chunks of ``CHUNK_ROWS`` lines, after its header (one scan)."""
  with open(path, "rb") as f:
    header = f.readline()
    start = len(header)
    size = _data_end(f, start)
    pos, lines, offsets = start, 0, [start]
    f.seek(start)
    block = f.read(min(1 << 24, size - pos))
    while block:
      ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
      # The newlines ending line CHUNK_ROWS, 2 * CHUNK_ROWS, ... (counted from 1).
      first_end = (-lines - 1) % CHUNK_ROWS
      offsets += (pos + ends[first_end::CHUNK_ROWS] + 1).tolist()
      lines += len(ends)
      pos += len(block)
      block = f.read(min(1 << 24, size - pos))
  total = lines + (1 if size > start else 0)  # the last line's newline lies past size
  chunks = []
  for c, begin in enumerate(offsets):
    stop = offsets[c + 1] if c + 1 < len(offsets) else size
    rows = min(CHUNK_ROWS, total - c * CHUNK_ROWS)
    if rows > 0:
      chunks.append(Chunk(path, first_row + c * CHUNK_ROWS, rows, start=begin, stop=stop,
                          first_line=2 + c * CHUNK_ROWS, file_row=c * CHUNK_ROWS))
  return chunks


def chunks(files: Files) -> list[Chunk]:
  """Every chunk of ``files``, in order.

  Raises:
    DataError: a file with no row (an empty table is a mistake, not a no-op).
  """
  out, first = [], 0
  for path in files.paths:
    if files.format == PARQUET:
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

      try:
        meta = pq.ParquetFile(path).metadata
      except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(f"{path} is not a readable Parquet file ({e}); remove it from the "
                        "path or rewrite it.") from None
      found, file_row = [], 0
      for g in range(meta.num_row_groups):
        rows = meta.row_group(g).num_rows
        if rows:
          found.append(Chunk(path, first, rows, row_group=g, file_row=file_row))
          first += rows
          file_row += rows
    else:
      found = text_chunks(path, first)
      first += sum(c.rows for c in found)
    if not found:
      raise DataError(f"{path} holds no rows; remove the empty file from the path, or write "
                      "its rows.")
    out += found
  return out
