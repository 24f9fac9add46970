"""What the training split says about each column, and the schema it resolves.

One pass over the training rows (every process reads them all, so every
process gets the same numbers) gives, a column:

- id columns: each value's count (up to ``COUNT_CAP`` distinct values),
  from which a ``vocab`` column takes its vocabulary (values seen at least
  ``min_count`` times, most frequent first, ids from 1; 0 is the missing and
  rare values' row) and an ``auto`` column its kind: ``vocab`` up to
  ``AUTO_VOCAB_MAX`` distinct values, ``dynamic`` past that;
- list columns: the longest row (a ``max_len`` of 0 takes it, at most
  ``MAX_LIST_LEN``);
- dense columns: mean and standard deviation (``standardize``, and the
  value of a null without a default), nulls, min and max;
- labels: the mean.

``Statistics`` is JSON (saved as ``statistics.json`` beside the schema), so
a resumed run, an export and a served model read the same vocabularies and
means.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embedlib.tabular import schema as schema_lib
from embedlib.tabular.schema import Schema, SchemaError

#: Most distinct values counted a column; past it, a column is high-cardinality.
COUNT_CAP = 1_000_000
#: A dynamic table's capacity a distinct training value, before rounding up.
DYNAMIC_ROWS_PER_ID = 2


@dataclasses.dataclass
class ColumnStats:
  """One column's numbers (the fields its role uses; see the module docstring)."""

  rows: int = 0
  nulls: int = 0
  counts: dict = dataclasses.field(default_factory=dict)
  capped: bool = False
  max_len: int = 0
  total_len: int = 0
  mean: float = 0.0
  m2: float = 0.0
  count: int = 0
  min: float = math.inf
  max: float = -math.inf

  @property
  def std(self) -> float:
    return math.sqrt(self.m2 / self.count) if self.count else 0.0

  def merge(self, other: ColumnStats) -> None:
    """Adds ``other`` (a later chunk's numbers) to these."""
    self.rows += other.rows
    self.nulls += other.nulls
    for value, n in other.counts.items():
      if value in self.counts:
        self.counts[value] += n
      elif len(self.counts) < COUNT_CAP:
        self.counts[value] = n
      else:
        self.capped = True
    self.capped |= other.capped
    self.max_len = max(self.max_len, other.max_len)
    self.total_len += other.total_len
    if other.count:  # Chan et al.'s pairwise update of the mean and squared deviations
      n = self.count + other.count
      delta = other.mean - self.mean
      self.mean += delta * other.count / n
      self.m2 += other.m2 + delta * delta * self.count * other.count / n
      self.count = n
      self.min, self.max = min(self.min, other.min), max(self.max, other.max)


def _values(array: pa.Array) -> pa.Array:
  return pc.list_flatten(array) if pa.types.is_list(array.type) else array


def chunk_stats(table: pa.Table, schema: Schema, label_threshold=None) -> dict:
  """``{column: ColumnStats}`` of one chunk's rows (``readers``' typed table)."""
  out = {}
  for name in table.column_names:
    c = schema[name]
    array = table.column(name).combine_chunks()
    s = ColumnStats(rows=len(array), nulls=array.null_count)
    if c.is_id:
      values = _values(array).drop_null()
      counted = pc.value_counts(values)
      s.counts = dict(zip(counted.field("values").to_pylist(),
                          counted.field("counts").to_pylist()))
      if c.role == schema_lib.LIST:
        lengths = pc.list_value_length(array).fill_null(0)
        s.max_len = int(pc.max(lengths).as_py() or 0)
        s.total_len = int(pc.sum(lengths).as_py() or 0)
    elif c.role in (schema_lib.DENSE, schema_lib.LABEL, schema_lib.TIMESTAMP):
      x = np.asarray(array.drop_null().to_numpy(zero_copy_only=False), np.float64)
      if c.role == schema_lib.LABEL and label_threshold is not None:
        x = (x >= label_threshold).astype(np.float64)
      if x.size:
        s.count, s.mean = int(x.size), float(x.mean())
        s.m2 = float(((x - s.mean) ** 2).sum())
        s.min, s.max = float(x.min()), float(x.max())
    out[name] = s
  return out


@dataclasses.dataclass
class Statistics:
  """Every column's numbers over the training split, and how many rows it holds."""

  rows: int = 0
  columns: dict = dataclasses.field(default_factory=dict)

  def add(self, chunk: dict) -> None:
    """Adds one chunk's ``chunk_stats``."""
    for name, s in chunk.items():
      self.columns.setdefault(name, ColumnStats()).merge(s)
    if chunk:
      self.rows += next(iter(chunk.values())).rows

  def vocab(self, column: schema_lib.Column) -> list:
    """The values of a ``vocab`` column with a row each, most frequent first (id 1 onward)."""
    counts = self.columns[column.name].counts
    kept = [(v, n) for v, n in counts.items() if n >= column.min_count]
    kept.sort(key=lambda vn: (-vn[1], str(vn[0])))
    return [v for v, _ in kept]

  def to_json(self, schema: Schema) -> str:
    """The numbers a reader needs again: vocabularies, means, deviations, lengths."""
    out = {"rows": self.rows, "columns": {}}
    for c in schema.columns:
      s = self.columns.get(c.name)
      if s is None:
        continue
      entry = {"rows": s.rows, "nulls": s.nulls}
      if c.is_id:
        entry.update(distinct=len(s.counts), capped=s.capped, max_len=s.max_len)
        if c.ids == schema_lib.VOCAB:
          entry["vocab"] = self.vocab(c)
      else:
        entry.update(mean=s.mean, std=s.std, count=s.count,
                     min=s.min if s.count else None, max=s.max if s.count else None)
      out["columns"][c.name] = entry
    return json.dumps(out) + "\n"


def _round_capacity(distinct: int) -> int:
  return 1 << max(7, math.ceil(math.log2(max(1, distinct * DYNAMIC_ROWS_PER_ID))))


def resolve(schema: Schema, stats: Statistics) -> Schema:
  """``schema`` with every ``auto`` id kind, table size and list length decided by ``stats``.

  Raises:
    SchemaError: a ``vocab`` column past ``COUNT_CAP`` distinct values, or
      a column the training split never fills.
  """
  columns = []
  for c in schema.columns:
    s = stats.columns.get(c.name)
    if c.role == schema_lib.IGNORE or s is None:
      columns.append(c)
      continue
    changes = {}
    if c.is_id:
      distinct = len(s.counts)
      kind = c.ids
      if kind == schema_lib.AUTO:
        kind = (schema_lib.DYNAMIC if s.capped or distinct > schema_lib.AUTO_VOCAB_MAX
                else schema_lib.VOCAB)
      if kind == schema_lib.VOCAB and s.capped:
        raise SchemaError(
            f"column {c.name!r}: ids='vocab' over more than {COUNT_CAP} distinct training "
            "values; give it ids='dynamic' (raw ids, admitted and evicted) or ids='hashed' "
            f"with num_embeddings (config.data.columns.{c.name}.ids).")
      changes["ids"] = kind
      if kind == schema_lib.VOCAB:
        changes["num_embeddings"] = 1 + sum(1 for n in s.counts.values() if n >= c.min_count)
      elif kind == schema_lib.DYNAMIC and not c.num_embeddings:
        changes["num_embeddings"] = _round_capacity(COUNT_CAP if s.capped else distinct)
      if c.role == schema_lib.LIST and not c.max_len:
        changes["max_len"] = max(1, min(s.max_len, schema_lib.MAX_LIST_LEN))
    columns.append(c.replace(**changes) if changes else c)
  return Schema(tuple(columns))


def from_json(text: str, where: str) -> dict:
  """A saved ``Statistics.to_json``, as the plain dict ``featurize`` reads."""
  try:
    raw = json.loads(text)
    raw["columns"]  # pylint: disable=pointless-statement
  except (ValueError, KeyError, TypeError) as e:
    raise SchemaError(f"{where} is not a run's statistics ({type(e).__name__}: {e}); delete "
                      "it with the schema beside it to compute both again.") from None
  return raw


def counter_of(stats: Statistics, name: str) -> collections.Counter:
  """A column's value counts (for tests and reports)."""
  return collections.Counter(stats.columns[name].counts)
