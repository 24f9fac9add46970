"""A table's schema: each column's role, type, id handling and null policy.

A schema is data (``Schema.to_json`` / ``from_json``): a run saves it in its
workdir, and resume, export and serving read it from there, so every reader
of the same files agrees on what each column means.

>>> schema = Schema((
...     Column("user_id", USER_ID, STRING),
...     Column("item_id", ITEM_ID, INT),
...     Column("categories", LIST, INT, entity="item"),
...     Column("price", DENSE, FLOAT, transform="log1p"),
...     Column("clicked", LABEL, INT),
... ))
>>> schema.features()
('user_id', 'item_id', 'categories')
>>> Schema.from_json(schema.to_json()) == schema
True
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing as tp

#: Roles. A categorical column holds one id a row; a list column a variable
#: number (multi-hot), optionally weighted by a ``WEIGHTS`` column of the
#: same lengths; ``USER_ID`` / ``ITEM_ID`` are categorical columns that key
#: the user and item (the two towers, the sequence models); ``DENSE``
#: columns are floats; ``LABEL`` columns are targets; ``TIMESTAMP`` orders
#: and splits rows; ``IGNORE`` is read by nothing.
CATEGORICAL, LIST, USER_ID, ITEM_ID = "categorical", "categorical_list", "user_id", "item_id"
DENSE, LABEL, TIMESTAMP, WEIGHTS, IGNORE = "dense", "label", "timestamp", "weights", "ignore"
ROLES = (CATEGORICAL, LIST, USER_ID, ITEM_ID, DENSE, LABEL, TIMESTAMP, WEIGHTS, IGNORE)
#: Roles whose column is an id (or ids) looked up in an embedding table.
ID_ROLES = (CATEGORICAL, LIST, USER_ID, ITEM_ID)

#: Value types (of the elements, for a list column).
INT, STRING, FLOAT = "int", "string", "float"
DTYPES = (INT, STRING, FLOAT)

#: How an id column's values become rows. ``dynamic``: raw 64-bit ids (a
#: string hashed, ``embedlib.tabular.hashing``) in a ``DynamicEmbed`` that
#: admits and evicts them; ``hashed``: the 64-bit id hashed into
#: ``num_embeddings`` rows; ``vocab``: a vocabulary of the training split's
#: values seen at least ``min_count`` times; ``auto``: ``vocab`` for a column
#: of at most ``AUTO_VOCAB_MAX`` distinct training values, ``dynamic`` past
#: that (chosen by ``embedlib.tabular.stats``, said in the printed schema).
DYNAMIC, HASHED, VOCAB, AUTO = "dynamic", "hashed", "vocab", "auto"
ID_KINDS = (DYNAMIC, HASHED, VOCAB, AUTO)
AUTO_VOCAB_MAX = 100_000

#: Dense transforms: ``log1p`` is ``log1p(max(x, 0))`` (counts, prices);
#: ``standardize`` is ``(x - mean) / std`` with the training split's
#: statistics.
NONE, LOG1P, STANDARDIZE = "none", "log1p", "standardize"
TRANSFORMS = (NONE, LOG1P, STANDARDIZE)

#: Null policies: ``default`` reads a null as the column's ``default`` (for
#: an id column without one: the missing id, a row of its own; for a dense
#: column without one: the training mean, 0 after ``standardize``); ``error``
#: stops at the first null, naming its file, row and column.
NULL_DEFAULT, NULL_ERROR = "default", "error"
NULL_POLICIES = (NULL_DEFAULT, NULL_ERROR)

#: Entities a column describes: the user tower's, the item tower's, or the
#: row's own (context: both towers' inputs leave it out).
ENTITIES = ("", "user", "item")


class SchemaError(ValueError):
  """A schema (or a file against it) that can't work; the message names the column and the fix."""


@dataclasses.dataclass(frozen=True)
class Column:
  """One column: its role, value type and how it is read.

  >>> Column("price", DENSE, FLOAT, transform="standardize").transform
  'standardize'
  >>> Column("price", DENSE, STRING)
  Traceback (most recent call last):
  ...
  embedlib.tabular.schema.SchemaError: column 'price': a dense column holds floats or ints, not string; give it role 'categorical' (a string id), or fix its type.

  Attributes:
    name: the column's name in the files.
    role: one of ``ROLES``.
    dtype: the value type (of the elements, for a list): ``int``, ``string``
      or ``float``.
    entity: ``"user"``, ``"item"`` or ``""``: the tower a side column feeds
      (``USER_ID`` and ``ITEM_ID`` columns are their entity's).
    ids: id columns: one of ``ID_KINDS``.
    num_embeddings: ``hashed``: the table's rows; ``dynamic``: its capacity
      (0: sized by the statistics). Ignored by ``vocab``.
    min_count: ``vocab``: the fewest training rows a value needs for a row
      of its own (rarer values share the missing id's row).
    transform: dense columns: one of ``TRANSFORMS``.
    null: one of ``NULL_POLICIES``.
    default: the value a null reads as (``null="default"``); None: see
      ``NULL_POLICIES``.
    weights: list columns: the name of a ``WEIGHTS`` column holding one
      float per id (the same lengths), or ``""``.
    max_len: list columns: ids kept a row (0: the training split's longest,
      at most ``MAX_LIST_LEN``); longer rows keep their first ``max_len``.
  """

  name: str
  role: str
  dtype: str
  entity: str = ""
  ids: str = AUTO
  num_embeddings: int = 0
  min_count: int = 1
  transform: str = NONE
  null: str = NULL_DEFAULT
  default: tp.Any = None
  weights: str = ""
  max_len: int = 0

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise SchemaError(f"a column name must be a non-empty string, got {self.name!r}.")
    owner = f"column {self.name!r}"
    for field, allowed in (("role", ROLES), ("dtype", DTYPES), ("entity", ENTITIES),
                           ("ids", ID_KINDS), ("transform", TRANSFORMS),
                           ("null", NULL_POLICIES)):
      value = getattr(self, field)
      if value not in allowed:
        raise SchemaError(f"{owner}: {field}={value!r}; use one of {allowed}.")
    for field in ("num_embeddings", "max_len"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"{owner}: {field} must be an int >= 0, got {value!r}.")
    if isinstance(self.min_count, bool) or not isinstance(self.min_count, int) \
        or self.min_count < 1:
      raise SchemaError(f"{owner}: min_count must be an int >= 1, got {self.min_count!r}.")
    if self.role == USER_ID and self.entity not in ("", "user"):
      raise SchemaError(f"{owner}: a user_id column is the user's; leave entity at ''.")
    if self.role == ITEM_ID and self.entity not in ("", "item"):
      raise SchemaError(f"{owner}: an item_id column is the item's; leave entity at ''.")
    if self.role in (USER_ID, ITEM_ID):
      object.__setattr__(self, "entity", self.role[:4])
    if self.role in (DENSE, WEIGHTS, TIMESTAMP) and self.dtype == STRING:
      what = {DENSE: "a dense", WEIGHTS: "a weights", TIMESTAMP: "a timestamp"}[self.role]
      raise SchemaError(f"{owner}: {what} column holds floats or ints, not string; give it "
                        "role 'categorical' (a string id), or fix its type.")
    if self.role in ID_ROLES and self.dtype == FLOAT:
      raise SchemaError(f"{owner}: an id column holds ints or strings, not floats; give it "
                        "role 'dense', or cast its ids to int in the files.")
    if self.role == LABEL and self.dtype == STRING:
      raise SchemaError(f"{owner}: a label is a number (0/1, or a rating with "
                        "data.label_threshold); it holds strings here.")
    if self.ids == HASHED and self.role in ID_ROLES and self.num_embeddings < 2:
      raise SchemaError(f"{owner}: ids='hashed' needs num_embeddings >= 2 (row 0 is the "
                        "missing id's); e.g. num_embeddings=100000.")
    if self.weights and self.role != LIST:
      raise SchemaError(f"{owner}: weights={self.weights!r} weigh the ids of a "
                        "categorical_list column; remove it here.")
    if self.transform != NONE and self.role != DENSE:
      raise SchemaError(f"{owner}: transform={self.transform!r} applies to dense columns.")
    if isinstance(self.default, float) and not math.isfinite(self.default):
      raise SchemaError(f"{owner}: default={self.default!r} must be finite.")

  @property
  def is_id(self) -> bool:
    """Whether the column's values are ids looked up in a table."""
    return self.role in ID_ROLES

  def replace(self, **changes) -> Column:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict:
    """Its fields that differ from the defaults (plus name, role, dtype)."""
    out = {}
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name in ("name", "role", "dtype") or value != field.default:
        out[field.name] = value
    return out


#: Most ids a list column keeps a row when its ``max_len`` is 0.
MAX_LIST_LEN = 64


@dataclasses.dataclass(frozen=True)
class Schema:
  """The columns a model reads, in file order, and the checks across them.

  Attributes:
    columns: every column read (``IGNORE`` ones included, so that a file
      check can tell an expected column from a new one).
  """

  columns: tuple[Column, ...]

  def __post_init__(self):
    columns = tuple(self.columns)
    object.__setattr__(self, "columns", columns)
    names = [c.name for c in columns]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
      raise SchemaError(f"columns {repeated} appear more than once; give each column once.")
    by_name = dict(zip(names, columns))
    for role in (USER_ID, ITEM_ID, TIMESTAMP):
      have = [c.name for c in columns if c.role == role]
      if len(have) > 1:
        raise SchemaError(f"columns {have} all have role {role!r}; a table has one. Give "
                          "the others role 'categorical'.")
    for c in columns:
      if c.role == LIST and c.weights:
        w = by_name.get(c.weights)
        if w is None or w.role != WEIGHTS:
          raise SchemaError(
              f"column {c.name!r}: weights={c.weights!r} must name a column of role "
              f"'weights' (a list of floats); "
              + ("there is no such column." if w is None else f"it has role {w.role!r}."))
    weighted = {c.weights for c in columns if c.role == LIST and c.weights}
    for c in columns:
      if c.role == WEIGHTS and c.name not in weighted:
        raise SchemaError(f"column {c.name!r} has role 'weights' but no categorical_list "
                          "column names it; set weights=<its name> on the list it weighs, "
                          "or give it role 'ignore'.")

  def __getitem__(self, name: str) -> Column:
    for c in self.columns:
      if c.name == name:
        return c
    raise KeyError(f"the schema has no column {name!r}; its columns: {self.names()}.")

  def __contains__(self, name: str) -> bool:
    return any(c.name == name for c in self.columns)

  def names(self, *roles: str) -> tuple[str, ...]:
    """Names of the columns with one of ``roles`` (every column's: no roles)."""
    return tuple(c.name for c in self.columns if not roles or c.role in roles)

  def read(self) -> tuple[str, ...]:
    """The columns a reader loads: every column but the ignored ones."""
    return tuple(c.name for c in self.columns if c.role != IGNORE)

  def features(self, entity: str | None = None) -> tuple[str, ...]:
    """The id columns (embedding lookups), in file order; of ``entity`` if given."""
    return tuple(c.name for c in self.columns
                 if c.is_id and (entity is None or c.entity == entity))

  def dense(self, entity: str | None = None) -> tuple[str, ...]:
    """The dense columns, in file order (the order of ``batch["dense"]``)."""
    return tuple(c.name for c in self.columns
                 if c.role == DENSE and (entity is None or c.entity == entity))

  def labels(self) -> tuple[str, ...]:
    return self.names(LABEL)

  def role_column(self, role: str) -> str | None:
    """The name of the one column of ``role`` (``USER_ID``, ``ITEM_ID``, ``TIMESTAMP``)."""
    names = self.names(role)
    return names[0] if names else None

  def replace(self, name: str, **changes) -> Schema:
    """A copy with column ``name`` changed (``Column.replace``)."""
    self[name]  # pylint: disable=pointless-statement  (names the column if missing)
    return Schema(tuple(c.replace(**changes) if c.name == name else c for c in self.columns))

  # -- JSON --------------------------------------------------------------------

  def to_json(self) -> str:
    return json.dumps({"columns": [c.to_dict() for c in self.columns]}, indent=2) + "\n"

  @classmethod
  def from_json(cls, text: str, *, where: str = "the schema") -> Schema:
    try:
      raw = json.loads(text)
      columns = raw["columns"]
    except (ValueError, KeyError, TypeError) as e:
      raise SchemaError(f"{where} is not a schema ({type(e).__name__}: {e}); write it with "
                        "Schema.to_json, or delete it to infer the schema again.") from None
    return cls(tuple(column_from_dict(c, where) for c in columns))

  # -- printing ------------------------------------------------------------------

  def describe(self) -> str:
    """One line a column: what it is and how it is read (printed at a run's start)."""
    rows = [("column", "role", "type", "entity", "read as")]
    for c in self.columns:
      rows.append((c.name, c.role, c.dtype, c.entity or "-", _read_as(c)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def _read_as(c: Column) -> str:
  parts = []
  if c.is_id:
    kind = c.ids
    if c.ids == HASHED:
      kind = f"hashed into {c.num_embeddings} rows"
    elif c.ids == VOCAB:
      kind = f"vocab (min_count {c.min_count})"
    elif c.ids == DYNAMIC and c.num_embeddings:
      kind = f"dynamic, capacity {c.num_embeddings}"
    parts.append(kind)
    if c.role == LIST:
      parts.append(f"max_len {c.max_len}" if c.max_len else "max_len from data")
      if c.weights:
        parts.append(f"weights {c.weights}")
  elif c.role == DENSE:
    parts.append(c.transform)
  if c.role != IGNORE:
    null = "error on null" if c.null == NULL_ERROR else (
        f"null -> {c.default!r}" if c.default is not None else "null -> default")
    parts.append(null)
  return ", ".join(parts)


def column_from_dict(raw: tp.Mapping, where: str = "the schema") -> Column:
  """A ``Column`` of ``to_dict``'s form (or a config's), naming an unknown key."""
  if not hasattr(raw, "keys") or "name" not in raw:
    raise SchemaError(f"{where}: a column must be a mapping with a 'name', got {raw!r}.")
  fields = {f.name for f in dataclasses.fields(Column)}
  unknown = sorted(set(raw.keys()) - fields)
  if unknown:
    raise SchemaError(f"{where}: column {raw['name']!r} has unknown key {unknown[0]!r}; "
                      f"a column's keys are {sorted(fields)}.")
  missing = [k for k in ("role", "dtype") if k not in raw]
  if missing:
    raise SchemaError(f"{where}: column {raw['name']!r} lacks {missing[0]!r}.")
  try:
    return Column(**{k: raw[k] for k in raw.keys()})
  except SchemaError as e:  # a value it can't take: said where it was given
    raise SchemaError(f"{where}: {e}") from None
