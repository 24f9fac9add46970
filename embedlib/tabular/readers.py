"""One chunk of a table's files read as Arrow columns of the schema's types.

Every reader gives the same thing: a ``pyarrow.Table`` holding the schema's
columns (``Schema.read()``), each of the canonical type of its role
(``arrow_type``), nulls kept (the featurizer applies each column's policy).
A value the schema can't read raises ``DataError`` naming the file, the row
(a text file's line, a Parquet file's row and row group) and the column.

- Parquet: one row group, only the schema's columns (``pyarrow.parquet``).
- CSV / TSV: one byte range of whole lines, every field read as text and
  then typed here, so that a bad value names its line. The empty field is
  null; a list is its values joined by ``list_separator`` (``|``); ``true``
  / ``false`` read as 1 / 0; a timestamp is a number or an ISO 8601 date /
  time.
- RecBole: the same for the ``.inter`` file (a ``token_seq`` or
  ``float_seq`` field is space-separated), its rows joined with the
  ``.user`` and ``.item`` files' on ``user_id`` and ``item_id`` (read once,
  in memory: they hold one row an entity).
"""

from __future__ import annotations

import csv
import io
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from embedlib.tabular import files as files_lib
from embedlib.tabular import schema as schema_lib
from embedlib.tabular.files import Chunk, DataError, Files
from embedlib.tabular.schema import Column, Schema

#: A list value's separator in CSV / TSV files (``config.data.list_separator``).
LIST_SEPARATOR = "|"
#: RecBole's atomic field types, and the value type each holds.
RECBOLE_TYPES = {"token": "string", "token_seq": "string", "float": "float",
                 "float_seq": "float"}
INT_TEXT = re.compile(r"^\s*[+-]?\d+\s*$")


def arrow_type(column: Column) -> pa.DataType:
  """The type a reader gives ``column``: int64 or string ids, float64 numbers, lists of them."""
  role = column.role
  if role == schema_lib.WEIGHTS:
    return pa.list_(pa.float64())
  if role in (schema_lib.DENSE, schema_lib.LABEL, schema_lib.TIMESTAMP):
    return pa.float64()
  value = pa.string() if column.dtype == schema_lib.STRING else pa.int64()
  return pa.list_(value) if role == schema_lib.LIST else value


def value_kind(t: pa.DataType) -> str:
  """``int``, ``float``, ``string``, ``bool``, ``time``, ``list`` or the type's name."""
  if pa.types.is_dictionary(t):
    return value_kind(t.value_type)
  for test, kind in ((pa.types.is_boolean, "bool"), (pa.types.is_integer, "int"),
                     (pa.types.is_floating, "float"), (pa.types.is_decimal, "float"),
                     (pa.types.is_string, "string"), (pa.types.is_large_string, "string"),
                     (pa.types.is_timestamp, "time"), (pa.types.is_date, "time")):
    if test(t):
      return kind
  if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
    return "list"
  return str(t)


def accepts(column: Column, t: pa.DataType) -> bool:
  kind = value_kind(t)
  role = column.role
  if role in (schema_lib.LIST, schema_lib.WEIGHTS):
    if kind != "list":
      return False
    inner = value_kind(t.value_type)
    if role == schema_lib.WEIGHTS:
      return inner in ("int", "float")
    return inner == ("string" if column.dtype == schema_lib.STRING else "int")
  if role in (schema_lib.DENSE, schema_lib.LABEL):
    return kind in ("int", "float", "bool")
  if role == schema_lib.TIMESTAMP:
    return kind in ("int", "float", "time")
  if column.dtype == schema_lib.STRING:
    return kind == "string"
  # Whole floats too: pandas writes an int column holding a null as float64.
  return kind in ("int", "bool", "float")


def conform(array, column: Column, where: str) -> pa.Array:
  """``array`` (a Parquet file's column) as ``arrow_type(column)``, or ``DataError``.

  Args:
    array: an Arrow array or chunked array.
    column: the schema's column.
    where: the file (and row group) for the error.
  """
  if isinstance(array, pa.ChunkedArray):
    array = array.combine_chunks()
  if pa.types.is_dictionary(array.type):
    array = array.dictionary_decode()
  t = array.type
  if not accepts(column, t):
    raise DataError(mismatch(column, t, where))
  if value_kind(t) == "time":
    return _seconds(array)
  if column.is_id and value_kind(t) == "float":
    whole = pc.fill_null(pc.equal(pc.floor(array), array), True)
    if not pc.all(whole).as_py():
      i = pc.index(whole, False).as_py()
      raise DataError(f"{where}, its row {i}: column {column.name!r} holds {array[i]}, which "
                      "is not a whole number, but the schema reads it as int ids; fix the "
                      f"value, or read the column as dense (config.data.dense).")
  if pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t):
    array = array.cast(pa.list_(t.value_type))
  # Unchecked: a uint64 id past 2**63 keeps its 64 bits (its two's complement, the same
  # raw id), and an int past 2**53 read as a float rounds; ``accepts`` checked the kinds.
  return array.cast(arrow_type(column), safe=False)


_PER_SECOND = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}


def _seconds(array: pa.Array) -> pa.Array:
  """Dates and timestamps (any unit, any zone) as float64 seconds since the epoch (UTC)."""
  if pa.types.is_date(array.type):
    array = pc.cast(array, pa.timestamp("ms"))
  ticks = pc.cast(pc.cast(array, pa.int64()), pa.float64(), safe=False)
  return pc.divide(ticks, float(_PER_SECOND[array.type.unit]))


def mismatch(column: Column, t: pa.DataType, where: str) -> str:
  kind, c = value_kind(t), column
  if c.role in (schema_lib.LIST, schema_lib.WEIGHTS) and kind != "list":
    return (f"{where}: column {c.name!r} holds scalars ({t}), but the schema reads it as a "
            f"{c.role} (a list a row); give it role 'categorical' or 'dense', or write lists.")
  if c.role in (schema_lib.DENSE, schema_lib.LABEL) and kind == "string":
    return (f"{where}: column {c.name!r} holds strings ({t}), but the schema reads it as a "
            f"{c.role} float; give it role 'categorical' (string ids), or write numbers.")
  if c.is_id and kind in ("int", "string") and c.role != schema_lib.LIST:
    return (f"{where}: column {c.name!r} holds {kind} values ({t}), but the schema reads "
            f"{c.dtype} ids; set its dtype to {kind!r} (config.data.columns.{c.name}.dtype), "
            "or rewrite the file.")
  return (f"{where}: column {c.name!r} holds {t}, which a {c.role} column of {c.dtype} values "
          "can't read; fix the column's role / dtype in the schema, or rewrite the file.")


# -- Parquet ---------------------------------------------------------------------


def read_parquet(chunk: Chunk, schema: Schema) -> pa.Table:
  """One row group's schema columns, typed (``conform``)."""
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  f = pq.ParquetFile(chunk.path)
  names = set(f.schema_arrow.names)
  wanted = schema.read()
  missing = [n for n in wanted if n not in names]
  if missing:
    raise DataError(f"{chunk.path}: no column {missing[0]!r}, which the schema reads; the "
                    f"file's columns are {sorted(names)}. Write the column, or drop it from "
                    "the schema (role 'ignore') and start a new run.")
  table = f.read_row_group(chunk.row_group, columns=list(wanted))
  where = f"{chunk.path} (row group {chunk.row_group})"
  return pa.table({n: conform(table.column(n), schema[n], where) for n in wanted})


# -- text: CSV, TSV, RecBole -----------------------------------------------------------


def _text_table(raw: bytes, header, delimiter: str) -> pa.Table:
  """Every field of ``raw`` (whole lines) as a nullable string."""
  names = list(header)
  options = pacsv.ReadOptions(column_names=names, use_threads=False)
  parse = pacsv.ParseOptions(delimiter=delimiter, quote_char='"' if delimiter != "\t" else False)
  convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                 strings_can_be_null=True, null_values=[""],
                                 quoted_strings_can_be_null=False)
  return pacsv.read_csv(io.BytesIO(raw), read_options=options, parse_options=parse,
                        convert_options=convert)


def _parse(strings: pa.Array, target: pa.DataType, times: bool) -> pa.Array | None:
  """``strings`` as ``target``, or None: numbers, then ``true`` / ``false`` (a CSV sample's
  booleans, read as 1 / 0 like Parquet's), then (``times``) ISO 8601 dates and times."""
  trimmed = pc.utf8_trim_whitespace(strings)
  parses = [lambda: pc.cast(trimmed, target),
            lambda: pc.cast(pc.cast(trimmed, pa.bool_()), target)]
  if times:
    parses.append(lambda: _seconds(pc.cast(trimmed, pa.timestamp("us"))))
  for parse in parses:
    try:
      return parse()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
      pass
  return None


def _numbers(strings: pa.Array, chunk: Chunk, name: str, integer: bool,
             times: bool = False) -> pa.Array:
  """Text fields as int64 (ids) or float64, naming the first that is neither."""
  target = pa.int64() if integer else pa.float64()
  parsed = _parse(strings, target, times)
  if parsed is not None:
    return parsed
  values = strings.to_pylist()
  bad = [i for i, v in enumerate(values) if v is not None
         and _parse(pa.array([v], pa.string()), target, times) is None]
  i = bad[0] if bad else next(i for i, v in enumerate(values) if v is not None)
  what = ("an int id" if integer else "a number or an ISO 8601 date / time" if times
          else "a number") if bad else "of one kind with the column's other values"
  raise DataError(f"{chunk.where(i)}: column {name!r} holds {values[i]!r}, which is not {what}; "
                  f"fix the value, or set the column's role / dtype in the schema "
                  f"(config.data.columns.{name}).")


def is_float(value) -> bool:
  if value is None:
    return True
  try:
    float(value)
    return True
  except ValueError:
    return False


def _typed(strings: pa.Array, column: Column, chunk: Chunk, separator: str) -> pa.Array:
  """One text column as ``arrow_type(column)``."""
  role, name = column.role, column.name
  if role in (schema_lib.LIST, schema_lib.WEIGHTS):
    lists = pc.split_pattern(strings, separator)
    values = pc.list_flatten(lists)
    values = pc.if_else(pc.equal(values, ""), pa.scalar(None, pa.string()), values)
    if role == schema_lib.LIST and column.dtype == schema_lib.STRING:
      typed = values
    else:
      flat_chunk = _FlatChunk(chunk, np.asarray(pc.list_parent_indices(lists)))
      typed = _numbers(values, flat_chunk, name, integer=role == schema_lib.LIST)
    offsets = lists.offsets
    out = pa.ListArray.from_arrays(offsets, typed, mask=lists.is_null())
    return out.cast(arrow_type(column))
  if column.is_id and column.dtype == schema_lib.STRING:
    return strings
  return _numbers(strings, chunk, name, integer=column.is_id, times=role == schema_lib.TIMESTAMP)


class _FlatChunk:
  """A chunk's ``where`` for the flattened values of a list column (row of each value)."""

  def __init__(self, chunk: Chunk, parents: np.ndarray):
    self.chunk, self.parents = chunk, parents

  def where(self, i: int) -> str:
    return self.chunk.where(int(self.parents[i]))


def read_text(chunk: Chunk, schema: Schema, files: Files, separator: str = LIST_SEPARATOR,
              header=None) -> pa.Table:
  """One byte range of a CSV / TSV (or RecBole) file's schema columns, typed."""
  with open(chunk.path, "rb") as f:
    f.seek(chunk.start)
    raw = f.read(chunk.stop - chunk.start)
  header = files.header if header is None else header
  names = [h.split(":")[0] for h in header] if files.format == files_lib.RECBOLE else header
  try:
    table = _text_table(raw, names, files.delimiter)
  except pa.ArrowInvalid as e:
    line = bad_line(raw, files.delimiter, len(names))
    where = (f"{chunk.path}:{chunk.first_line + line}" if line is not None else
             f"{chunk.path}, lines {chunk.first_line} to {chunk.first_line + chunk.rows - 1}")
    raise DataError(f"{where}: not {len(names)} fields a line as the header says "
                    f"({_arrow_reason(e)}); fix the file's lines.") from None
  if table.num_rows != chunk.rows:
    lines = raw.split(b"\n")
    empty = next((i for i, line in enumerate(lines) if not line.strip(b"\r")), len(lines))
    if empty < chunk.rows:
      raise DataError(f"{chunk.path}:{chunk.first_line + empty}: an empty line; each line "
                      "after the header is a row: remove it.")
    raise DataError(f"{chunk.path}, lines {chunk.first_line} to "
                    f"{chunk.first_line + chunk.rows - 1}: {table.num_rows} rows in "
                    f"{chunk.rows} lines: a quoted field holds a line break, which this "
                    "reader can't split on; remove line breaks inside fields.")
  wanted = [n for n in schema.read() if n in names]
  return pa.table({n: _typed(table.column(n).combine_chunks(), schema[n], chunk, separator)
                   for n in wanted})


def bad_line(raw: bytes, delimiter: str, fields: int) -> int | None:
  """The index (from 0) of ``raw``'s first line that does not split into ``fields`` fields."""
  quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
  lines = csv.reader(io.StringIO(raw.decode("utf-8", "replace"), newline=""),
                     delimiter=delimiter, quoting=quoting)
  for row in lines:
    if row and len(row) != fields:
      return lines.line_num - 1
  return None


def _arrow_reason(e: Exception) -> str:
  return str(e).split("\n")[0]
