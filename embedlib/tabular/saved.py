"""A run's schema and statistics on disk, and the check of files against them.

A run writes ``schema.json`` (the resolved schema) and ``statistics.json``
(vocabularies, means) into its workdir once its model is built; a resumed
run, ``python -m train.export`` and a served artifact read them back, so a
value becomes the same id in each. Files are written to a temporary name
and renamed: a process killed mid-write leaves the old file or none.
"""

from __future__ import annotations

import os

import pyarrow as pa

from embedlib.tabular import files as files_lib
from embedlib.tabular import infer
from embedlib.tabular import readers
from embedlib.tabular import schema as schema_lib
from embedlib.tabular import stats as stats_lib
from embedlib.tabular.files import DataError, Files
from embedlib.tabular.schema import Schema

SCHEMA_FILE = "schema.json"
STATISTICS_FILE = "statistics.json"


def _write(path: str, text: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def save(directory: str, schema: Schema, statistics: str) -> None:
  """Writes ``schema.json`` and ``statistics.json`` (``Statistics.to_json``'s text)."""
  _write(os.path.join(directory, STATISTICS_FILE), statistics)
  _write(os.path.join(directory, SCHEMA_FILE), schema.to_json())


def has(directory: str) -> bool:
  return os.path.exists(os.path.join(directory, SCHEMA_FILE))


def load(directory: str) -> tuple[Schema, dict]:
  """``(schema, statistics)`` saved in ``directory``.

  Raises:
    SchemaError: either file is missing or not what ``save`` writes.
  """
  paths = [os.path.join(directory, n) for n in (SCHEMA_FILE, STATISTICS_FILE)]
  for path in paths:
    if not os.path.exists(path):
      raise schema_lib.SchemaError(
          f"{path} is missing: a run on your own files keeps its schema and statistics "
          "there. Pass the workdir of such a run (or, for a new run, a new workdir).")
  with open(paths[0]) as f:
    schema = Schema.from_json(f.read(), where=paths[0])
  with open(paths[1]) as f:
    statistics = stats_lib.from_json(f.read(), where=paths[1])
  return schema, statistics


def column_names(files: Files, separator: str = readers.LIST_SEPARATOR) -> set[str]:
  """The names of the columns the files hold (a RecBole dataset's side files' too)."""
  if files.format == files_lib.CSV:
    return set(files.header)
  return {c.name for c in infer.file_columns(files, separator)}


def without_absent_labels(files: Files, schema: Schema,
                          separator: str = readers.LIST_SEPARATOR) -> Schema:
  """``schema`` with the label columns the files lack ignored (files to score)."""
  names = column_names(files, separator)
  for c in schema.columns:
    if c.role == schema_lib.LABEL and c.name not in names:
      schema = schema.replace(c.name, role=schema_lib.IGNORE)
  return schema


#: Lines of each CSV file read as the schema says when the files are checked against it.
CHECK_LINES = 100


def check_files(files: Files, schema: Schema, separator: str = readers.LIST_SEPARATOR,
                *, need_labels: bool = True, saved: bool = True) -> list[str]:
  """Refuses files whose columns no longer match ``schema``; returns the columns it ignores.

  Every column the schema reads must be in the files with a type it can
  read (the files' own types: Parquet's and RecBole's; a CSV file's header,
  and its first ``CHECK_LINES`` lines read as the schema says).

  Args:
    need_labels: False to accept files without the label columns (scoring).
    saved: the schema is a run's, saved in its workdir (said in the errors).

  Raises:
    DataError: naming the first file and column that don't match, and the fix.
  """
  if files.format == files_lib.CSV:
    found = {n: None for n in files.header}
    _check_text(files, schema, separator)
  else:
    found = {c.name: c for c in infer.file_columns(files, separator)}
    if files.format == files_lib.PARQUET:
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

      for path in files.paths:
        arrow = pq.read_schema(path)
        _check_arrow(path, arrow, schema, need_labels, saved)
  for c in schema.columns:
    if c.role == schema_lib.IGNORE or (c.role == schema_lib.LABEL and not need_labels):
      continue
    if c.name not in found:
      raise DataError(f"{files.paths[0]}: no column {c.name!r}, which this run's schema reads "
                      f"(as {c.role}); the file's columns are {sorted(found)}. Pass files "
                      "with the run's columns, or train a new run on these.")
    have = found[c.name]
    if files.format == files_lib.RECBOLE and have is not None and (
        have.dtype != c.dtype and c.is_id or (c.role == schema_lib.LIST) != (
            have.role == schema_lib.LIST)):
      raise DataError(f"{files.paths[0]}: column {c.name!r} is {have.role} of {have.dtype} "
                      f"there; this run's schema reads it as {c.role} of {c.dtype}. Pass "
                      "files with the run's columns, or train a new run on these.")
  return sorted(set(found) - set(schema.names()))


def _check_text(files: Files, schema: Schema, separator: str) -> None:
  """Reads each text file's first lines as ``schema`` says (a retyped column names its line).

  A CSV header carries no types: an int id column that now holds strings
  would otherwise be found only when a run (or a resumed one) reads it.
  """
  for path in files.paths:
    with open(path, "rb") as f:
      start = len(f.readline())
      lines = [line for line in (f.readline() for _ in range(CHECK_LINES)) if line]
    while lines and not lines[-1].strip():  # blank lines at a file's end hold no row
      lines.pop()
    if lines:  # an empty file is files.chunks' error
      chunk = files_lib.Chunk(path, 0, len(lines), start=start,
                              stop=start + sum(map(len, lines)), first_line=2)
      readers.read_text(chunk, schema, files, separator)


def _check_arrow(path: str, arrow: pa.Schema, schema: Schema, need_labels: bool,
                 saved: bool) -> None:
  types = {f.name: f.type for f in arrow}
  for c in schema.columns:
    if c.role == schema_lib.IGNORE or (c.role == schema_lib.LABEL and not need_labels):
      continue
    if c.name not in types:
      raise DataError(f"{path}: no column {c.name!r}, which this run's schema reads (as "
                      f"{c.role}); the file's columns are {sorted(types)}. Pass files with "
                      "the run's columns, or train a new run on these.")
    if not readers.accepts(c, types[c.name]):
      whose = " (this run's schema, saved in its workdir)" if saved else ""
      raise DataError(readers.mismatch(c, types[c.name], path) + whose)
