"""RecBole's atomic files: the ``.inter`` rows joined with their ``.user`` and ``.item`` rows.

RecBole's header types each field ``name:type``: ``token`` (a string id),
``token_seq`` (space-separated string ids), ``float`` and ``float_seq``.
``.user`` holds one row a user keyed by ``user_id``, ``.item`` one row an
item keyed by ``item_id``; their other fields are the user's and the
item's side columns. They are read whole, once a process (a worker), and
joined to each chunk of ``.inter`` rows: a user or item with no row there
reads its side columns as nulls (the columns' null policies apply).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from embedlib.tabular import files as files_lib
from embedlib.tabular import readers
from embedlib.tabular import schema as schema_lib
from embedlib.tabular.files import DataError, Files
from embedlib.tabular.schema import Schema

#: The separator of a ``token_seq`` / ``float_seq`` field.
SEQ_SEPARATOR = " "


def header_types(path: str, header) -> list[tuple[str, str]]:
  """``[(name, type)]`` of a RecBole header, or ``DataError`` naming the bad field."""
  out = []
  for field in header:
    name, colon, kind = field.partition(":")
    if not colon or kind not in readers.RECBOLE_TYPES:
      raise DataError(f"{path}:1: header field {field!r} is not 'name:type' with type one of "
                      f"{tuple(readers.RECBOLE_TYPES)} (RecBole's atomic header, e.g. "
                      "'user_id:token').")
    out.append((name, kind))
  return out


class Sides:
  """A RecBole dataset's ``.user`` and ``.item`` tables, joined to ``.inter`` chunks.

  Args:
    files: the dataset (``files.find`` of its ``.inter`` file).
    schema: the columns read; a side file's columns of ``entity`` user /
      item are taken from it.
  """

  def __init__(self, files: Files, schema: Schema):
    self.tables = {}
    # A name the .inter file (or an earlier side file) holds is that file's column, as in
    # ``infer.recbole_columns``: a side file's column of the same name is not read.
    taken = {n for n, _ in header_types(files.paths[0], files.header)}
    for entity, path in files.side_paths.items():
      key = schema.role_column(schema_lib.USER_ID if entity == "user" else schema_lib.ITEM_ID)
      header = files_lib.read_header(path, "\t")
      names = [n for n, _ in header_types(path, header)]
      wanted = [n for n in names if n in schema and schema[n].role != schema_lib.IGNORE
                and n != key and n not in taken]
      taken.update(names)
      if key is None or not wanted:
        continue
      if key not in names:
        raise DataError(f"{path}:1: no {key!r} field to join on; a RecBole .{entity} file "
                        f"keys its rows by the {entity} id field of the .inter file.")
      side = Files(files_lib.RECBOLE, (path,), "\t", header)
      parts = [readers.read_text(c, _side_schema(schema, key, wanted), side, SEQ_SEPARATOR)
               for c in files_lib.text_chunks(path, 0)]
      table = pa.concat_tables(parts) if parts else None
      if table is None:
        continue
      keys = table.column(key).combine_chunks()
      if keys.null_count or len(pc.unique(keys)) != len(keys):
        raise DataError(f"{path}: {key} is empty or repeated on some line; a .{entity} file "
                        f"holds one line per {entity}.")
      self.tables[entity] = (key, keys, table.select(wanted))

  def join(self, inter: pa.Table) -> pa.Table:
    """``inter`` with each side file's columns appended, row by row."""
    for key, keys, table in self.tables.values():
      if key not in inter.column_names:
        continue
      index = pc.index_in(inter.column(key), value_set=keys)
      taken = table.take(index)
      for name in table.column_names:
        inter = inter.append_column(name, taken.column(name))
    return inter


def _side_schema(schema: Schema, key: str, wanted) -> Schema:
  """The schema columns a side file is read with: its key, as a plain string id, and ``wanted``."""
  key_column = schema_lib.Column(key, schema_lib.CATEGORICAL, schema[key].dtype)
  return Schema((key_column,) + tuple(schema[n] for n in wanted))


def read_chunk(chunk, schema: Schema, files: Files, sides: Sides) -> pa.Table:
  """One ``.inter`` chunk's columns joined with the side files' (see the module docstring)."""
  table = readers.read_text(chunk, schema, files, SEQ_SEPARATOR)
  return sides.join(table)
