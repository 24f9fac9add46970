"""A schema inferred from the files themselves, then corrected by what the user declares.

What each file type says about a column, and the role it gets:

=====================  ============================  ===========================
file type              role                          notes
=====================  ============================  ===========================
string / token         categorical (string ids)
int, bool              categorical (int ids)         declare ``dense`` for counts
float, decimal         dense (``standardize``)
list of int / string   categorical_list              token_seq too
list of float          weights of ``<list>`` if      ``<list>_weight(s)``; else
                       named ``<list>_weight(s)``    ignored
timestamp, date        timestamp if it is the one    else ignored
anything else          ignored                       said in the printed schema
=====================  ============================  ===========================

CSV / TSV fields carry no type: the first rows are read to tell ints,
floats and strings apart, and a text column whose values hold the list
separator is a list. Then ``Hints``: the label columns, the user / item id
and timestamp columns (by default the columns named ``user_id``,
``item_id``, ``timestamp``), which columns describe the user and the item
(a RecBole dataset's ``.user`` and ``.item`` columns do), columns to read
as dense or to ignore, and any column's fields set outright.
"""

from __future__ import annotations

import dataclasses
import io
import typing as tp

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from embedlib.tabular import files as files_lib
from embedlib.tabular import readers
from embedlib.tabular import recbole
from embedlib.tabular import schema as schema_lib
from embedlib.tabular.files import DataError, Files
from embedlib.tabular.schema import Column, Schema, SchemaError

#: Bytes of a text file read to infer its columns' types.
SAMPLE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Hints:
  """What the user says about the columns (``config.data``), applied over the inferred types.

  Attributes:
    labels: the label columns (``config.data.label``; several for several
      targets).
    user_id, item_id, timestamp: those columns' names ("" for the default:
      a column of that very name, if any).
    user_columns, item_columns: side columns of the user and of the item.
    dense: int columns to read as dense numbers, not ids.
    ignore: columns no model reads.
    columns: ``{name: {field: value}}``: any column's fields set outright
      (``Column``'s fields; a column the files lack is an error, as a misspelt
      name would read nothing).
  """

  labels: tuple[str, ...] = ()
  user_id: str = ""
  item_id: str = ""
  timestamp: str = ""
  user_columns: tuple[str, ...] = ()
  item_columns: tuple[str, ...] = ()
  dense: tuple[str, ...] = ()
  ignore: tuple[str, ...] = ()
  columns: tp.Mapping[str, tp.Mapping] = dataclasses.field(default_factory=dict)


def _from_arrow(name: str, t: pa.DataType) -> Column:
  kind = readers.value_kind(t)
  if kind == "string":
    return Column(name, schema_lib.CATEGORICAL, schema_lib.STRING)
  if kind in ("int", "bool"):
    return Column(name, schema_lib.CATEGORICAL, schema_lib.INT)
  if kind == "float":
    return Column(name, schema_lib.DENSE, schema_lib.FLOAT, transform=schema_lib.STANDARDIZE)
  if kind == "time":
    return Column(name, schema_lib.TIMESTAMP, schema_lib.INT)
  if kind == "list":
    inner = readers.value_kind(t.value_type)
    if inner in ("int", "bool"):
      return Column(name, schema_lib.LIST, schema_lib.INT)
    if inner == "string":
      return Column(name, schema_lib.LIST, schema_lib.STRING)
    if inner == "float":
      return Column(name, schema_lib.WEIGHTS, schema_lib.FLOAT)
  return Column(name, schema_lib.IGNORE, schema_lib.STRING)


def arrow_columns(arrow_schema: pa.Schema) -> list[Column]:
  """A column of each field of an Arrow schema, by its type (the table above)."""
  return [_from_arrow(f.name, f.type) for f in arrow_schema]


def _recbole_column(name: str, kind: str, entity: str) -> Column:
  if kind == "token":
    return Column(name, schema_lib.CATEGORICAL, schema_lib.STRING, entity=entity)
  if kind == "token_seq":
    return Column(name, schema_lib.LIST, schema_lib.STRING, entity=entity)
  if kind == "float":
    return Column(name, schema_lib.DENSE, schema_lib.FLOAT, entity=entity,
                  transform=schema_lib.STANDARDIZE)
  return Column(name, schema_lib.WEIGHTS, schema_lib.FLOAT, entity=entity)


def recbole_columns(files: Files) -> list[Column]:
  """The ``.inter`` file's columns, then each side file's (their entity's), from the headers."""
  out = [_recbole_column(n, k, "") for n, k in recbole.header_types(files.paths[0],
                                                                     files.header)]
  seen = {c.name for c in out}
  for entity, path in files.side_paths.items():
    for name, kind in recbole.header_types(path, files_lib.read_header(path, "\t")):
      if name not in seen:
        out.append(_recbole_column(name, kind, entity))
        seen.add(name)
  return out


def _text_sample(files: Files, separator: str) -> list[Column]:
  """CSV columns typed from the first ``SAMPLE_BYTES`` of the first file."""
  path = files.paths[0]
  with open(path, "rb") as f:
    f.readline()
    sample = f.read(SAMPLE_BYTES)
  if len(sample) == SAMPLE_BYTES:  # whole lines only
    sample = sample[:sample.rfind(b"\n") + 1]
  if not sample.strip():
    raise DataError(f"{path} holds no rows; remove the empty file from the path, or write "
                    "its rows.")
  options = pacsv.ReadOptions(column_names=list(files.header), use_threads=False)
  parse = pacsv.ParseOptions(delimiter=files.delimiter)
  convert = pacsv.ConvertOptions(strings_can_be_null=True, null_values=[""])
  try:
    table = pacsv.read_csv(io.BytesIO(sample), read_options=options, parse_options=parse,
                           convert_options=convert)
  except pa.ArrowInvalid as e:
    line = readers.bad_line(sample, files.delimiter, len(files.header))
    where = path if line is None else f"{path}:{line + 2}"  # the sample starts at line 2
    raise DataError(f"{where}: not the header's {len(files.header)} fields "
                    f"({str(e).splitlines()[0]}); fix the file, or pass "
                    "config.data.delimiter.") from None
  out = []
  for name in files.header:
    array = table.column(name)
    if pa.types.is_null(array.type):  # no value in the sample
      out.append(Column(name, schema_lib.CATEGORICAL, schema_lib.STRING))
      continue
    column = _from_arrow(name, array.type)
    if column.role == schema_lib.CATEGORICAL and column.dtype == schema_lib.STRING:
      column = _text_list(name, array.combine_chunks(), separator) or column
    out.append(column)
  return out


def _text_list(name: str, strings: pa.Array, separator: str) -> Column | None:
  """A list column, if any sampled value holds ``separator`` (ints if every element is one)."""
  if not pc.any(pc.match_substring(strings, separator)).as_py():
    return None
  values = pc.list_flatten(pc.split_pattern(strings, separator))
  values = pc.filter(values, pc.not_equal(values, ""))
  ints = pc.all(pc.match_substring_regex(values, readers.INT_TEXT.pattern)).as_py()
  if ints:
    return Column(name, schema_lib.LIST, schema_lib.INT)
  floats = all(readers.is_float(v) for v in values.to_pylist()[:1000])
  if floats:
    return Column(name, schema_lib.WEIGHTS, schema_lib.FLOAT)
  return Column(name, schema_lib.LIST, schema_lib.STRING)


def file_columns(files: Files, separator: str = readers.LIST_SEPARATOR) -> list[Column]:
  """The columns the files hold, typed from what they say (before any ``Hints``)."""
  if files.format == files_lib.PARQUET:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    return arrow_columns(pq.read_schema(files.paths[0]))
  if files.format == files_lib.RECBOLE:
    return recbole_columns(files)
  return _text_sample(files, separator)


def infer(files: Files, hints: Hints = Hints(),
          separator: str = readers.LIST_SEPARATOR) -> Schema:
  """The schema of ``files``: their columns' types (the module table), then ``hints``.

  Raises:
    SchemaError: a hint names a column the files don't hold, or sets a field
      a column can't take; the message names it and the fix.
  """
  columns = {c.name: c for c in file_columns(files, separator)}
  return apply_hints(columns, hints, where=files.paths[0])


def _need(columns, name: str, key: str, where: str) -> None:
  if name not in columns:
    raise SchemaError(f"config.data.{key}: {where} has no column {name!r}; its columns are "
                      f"{sorted(columns)}.")


def apply_hints(columns: dict[str, Column], hints: Hints, where: str) -> Schema:
  """``hints`` over ``columns`` (name -> inferred column), as one checked schema."""
  columns = dict(columns)
  for name in hints.labels:
    _need(columns, name, "label", where)
    if columns[name].dtype == schema_lib.STRING:
      raise SchemaError(f"config.data.label: column {name!r} of {where} holds strings; a label "
                        "is a number (0/1, or a rating with config.data.label_threshold). Name "
                        "a numeric column.")
    columns[name] = Column(name, schema_lib.LABEL, schema_lib.FLOAT, null=schema_lib.NULL_ERROR)
  # Time-typed columns: the timestamp is the one named (or called "timestamp"), else the
  # only one; the others are ignored.
  times = [n for n, c in columns.items() if c.role == schema_lib.TIMESTAMP]
  for name in times:
    columns[name] = columns[name].replace(role=schema_lib.IGNORE)
  for role, given, default in ((schema_lib.USER_ID, hints.user_id, "user_id"),
                               (schema_lib.ITEM_ID, hints.item_id, "item_id"),
                               (schema_lib.TIMESTAMP, hints.timestamp, "timestamp")):
    name = given or (default if default in columns else "")
    if not name and role == schema_lib.TIMESTAMP and len(times) == 1:
      name = times[0]
    if not name:
      continue
    _need(columns, name, role, where)
    c = columns[name]
    if role == schema_lib.TIMESTAMP:
      columns[name] = Column(name, role, schema_lib.INT if c.dtype != schema_lib.FLOAT
                             else schema_lib.FLOAT)
    else:
      dtype = c.dtype if c.dtype != schema_lib.FLOAT else schema_lib.INT
      columns[name] = Column(name, role, dtype)
  for key, names, entity in (("user_columns", hints.user_columns, "user"),
                             ("item_columns", hints.item_columns, "item")):
    for name in names:
      _need(columns, name, key, where)
      columns[name] = columns[name].replace(entity=entity)
  for name in hints.dense:
    _need(columns, name, "dense", where)
    c = columns[name]
    columns[name] = Column(name, schema_lib.DENSE, schema_lib.FLOAT, entity=c.entity,
                           transform=schema_lib.STANDARDIZE)
  for name in hints.ignore:
    _need(columns, name, "ignore", where)
    columns[name] = columns[name].replace(role=schema_lib.IGNORE)
  for name, fields in hints.columns.items():
    _need(columns, name, f"columns.{name}", where)
    base = columns[name].to_dict()
    if dict(fields).get("role", base["role"]) != base["role"]:  # the old role's fields go
      base = {k: base[k] for k in ("name", "dtype", "entity") if k in base}
    fields = {**base, **dict(fields), "name": name}
    columns[name] = schema_lib.column_from_dict(fields, f"config.data.columns.{name}")
  _pair_weights(columns)
  return Schema(tuple(columns.values()))


def _pair_weights(columns: dict[str, Column]) -> None:
  """Gives each weights column named ``<list>_weight(s)`` to its list; ignores the others."""
  for name, c in list(columns.items()):
    if c.role != schema_lib.WEIGHTS:
      continue
    owner = next((columns[s] for s in (name[:-len(suffix)] for suffix in ("_weights", "_weight")
                                       if name.endswith(suffix)) if s in columns), None)
    if owner is not None and owner.role == schema_lib.LIST and not owner.weights:
      columns[owner.name] = owner.replace(weights=name)
    elif not any(o.weights == name for o in columns.values()):
      columns[name] = c.replace(role=schema_lib.IGNORE)
