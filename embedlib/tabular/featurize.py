"""Typed Arrow columns to the arrays a model reads: ids, bags, weights, dense, labels.

``Featurizer(schema, statistics)`` turns a reader's table into::

    {
        "dense":  float32 [n, D]           the dense columns, schema order,
                                           each null-filled and transformed,
        "sparse": {column: ids},           each id column:
                  int32 [n] / [n, L]       vocab and hashed rows (0: missing),
                  uint64 [n] / [n, L]      dynamic columns' raw ids
                                           (``embedlib.tabular.hashing``),
                  lists padded on the right with -1 (``PAD`` for raw ids),
        "weights": {column: float32 [n, L]}  weighted lists (0 at padding),
        "label":  float32 [n]              one label; [n, K] for K labels,
        "timestamp": float64 [n]           where the schema has one,
    }

The same arrays, bit for bit, in training, export and serving: the one
place a value becomes an id. Imports numpy and pyarrow only.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embedlib.tabular import hashing
from embedlib.tabular import schema as schema_lib
from embedlib.tabular.files import DataError
from embedlib.tabular.schema import Column, Schema


def _where(locate, i: int) -> str:
  return locate(i) if locate is not None else f"row {i}"


def _nulls(array) -> np.ndarray:
  return np.asarray(array.is_null().to_numpy(zero_copy_only=False), bool)


def _check_nulls(array, column: Column, locate, what="") -> None:
  if column.null == schema_lib.NULL_ERROR and array.null_count:
    i = int(np.flatnonzero(_nulls(array))[0])
    raise DataError(f"{_where(locate, i)}: column {column.name!r} is null{what}, and its null "
                    f"policy is 'error'; fill the value, or give the column a default "
                    f"(config.data.columns.{column.name}.null='default').")


class Featurizer:
  """A resolved schema (``stats.resolve``) and its statistics, applied to tables.

  Args:
    schema: every id kind, table size and list length decided.
    statistics: ``Statistics.to_json``'s dict (vocabularies, means).
    label_threshold: a label ``>=`` this reads 1, below it 0; None keeps the
      labels' values.
  """

  def __init__(self, schema: Schema, statistics: dict, label_threshold=None):
    self.schema, self.label_threshold = schema, label_threshold
    columns = statistics["columns"]
    self.vocabs = {}
    self.means, self.stds = {}, {}
    for c in schema.columns:
      s = columns.get(c.name, {})
      if c.is_id and c.ids == schema_lib.VOCAB:
        if "vocab" not in s:
          raise schema_lib.SchemaError(
              f"column {c.name!r} is a vocab column, but the statistics hold no vocabulary "
              "for it; compute them again (delete schema.json and statistics.json).")
        t = pa.string() if c.dtype == schema_lib.STRING else pa.int64()
        self.vocabs[c.name] = pa.array(s["vocab"], t)
      if c.role == schema_lib.DENSE:
        self.means[c.name] = float(s.get("mean") or 0.0)
        std = float(s.get("std") or 0.0)
        self.stds[c.name] = std if std > 0 else 1.0

  def __call__(self, table: pa.Table, locate=None) -> dict:
    """The arrays of ``table``'s rows (see the module docstring).

    Args:
      table: a reader's typed table (``readers``).
      locate: ``i -> "file:line"`` of row ``i``, for errors (``Chunk.where``).
    """
    n = table.num_rows
    schema = self.schema
    out = {"sparse": {}, "weights": {}}
    for name in schema.features():
      c = schema[name]
      array = table.column(name).combine_chunks()
      if c.role == schema_lib.LIST:
        out["sparse"][name], weights = self._bags(c, array, table, locate)
        if weights is not None:
          out["weights"][name] = weights
      else:
        out["sparse"][name] = self._ids(c, array, locate)
    dense = [self._dense(schema[name], table.column(name).combine_chunks(), locate)
             for name in schema.dense()]
    out["dense"] = (np.stack(dense, axis=1) if dense else np.zeros((n, 0), np.float32))
    labels = [self._label(schema[name], table.column(name).combine_chunks(), locate)
              for name in schema.labels()]
    if labels:
      out["label"] = labels[0] if len(labels) == 1 else np.stack(labels, axis=1)
    ts = schema.role_column(schema_lib.TIMESTAMP)
    if ts is not None and ts in table.column_names:
      array = table.column(ts).combine_chunks()
      _check_nulls(array, schema[ts], locate)
      out["timestamp"] = np.asarray(pc.fill_null(array, 0.0).to_numpy(zero_copy_only=False),
                                    np.float64)
    return out

  # -- ids ---------------------------------------------------------------------------

  def _filled(self, c: Column, array, locate, what=""):
    _check_nulls(array, c, locate, what)
    if c.default is not None and array.null_count:
      t = array.type
      default = str(c.default) if pa.types.is_string(t) else int(c.default)
      array = pc.fill_null(array, pa.scalar(default, t))
    return array

  def _rows(self, c: Column, values) -> np.ndarray:
    """Ids of a flat array of values: int32 rows, or uint64 raw ids (dynamic)."""
    if c.ids == schema_lib.VOCAB:
      index = pc.index_in(values, value_set=self.vocabs[c.name])
      return np.asarray(pc.fill_null(index, -1).to_numpy(zero_copy_only=False),
                        np.int64).astype(np.int32) + 1
    raw = hashing.raw_ids(values)
    if c.ids == schema_lib.HASHED:
      return hashing.hashed_rows(raw, c.name, c.num_embeddings)
    return raw

  def _ids(self, c: Column, array, locate) -> np.ndarray:
    return self._rows(c, self._filled(c, array, locate))

  def _bags(self, c: Column, array, table, locate):
    """``[n, max_len]`` ids of a list column (and its weights), padded, truncated."""
    _check_nulls(array, c, locate)
    lists = pc.fill_null(array, pa.scalar([], array.type)) if array.null_count else array
    values = lists.flatten()
    if values.null_count:
      _check_nulls(values, c, lambda i: _where(locate, _parent(lists, i)), " in a list")
    ids = self._rows(c, self._filled(c, values, None))
    offsets = np.asarray(lists.offsets.to_numpy(zero_copy_only=False), np.int64)
    offsets = offsets - offsets[0]
    width = c.max_len
    lengths = np.minimum(np.diff(offsets), width)
    cols = np.arange(width)
    keep = cols[None, :] < lengths[:, None]
    index = np.where(keep, offsets[:-1, None] + cols[None, :], 0)
    pad = hashing.PAD if ids.dtype == np.uint64 else np.int32(-1)
    bags = np.where(keep, ids[index] if ids.size else pad, pad).astype(ids.dtype)
    if not c.weights:
      return bags, None
    w_lists, w_len, unweighted = _weight_lists(c, np.diff(offsets), table, locate)
    flat_w = np.asarray(pc.fill_null(w_lists.flatten(), 1.0).to_numpy(zero_copy_only=False),
                        np.float32)
    w_offsets = np.concatenate([[0], np.cumsum(w_len)])
    w_index = np.where(keep & ~unweighted[:, None], w_offsets[:-1, None] + cols[None, :], 0)
    weighted = flat_w[w_index] if flat_w.size else np.ones(w_index.shape, np.float32)
    weights = np.where(keep, np.where(unweighted[:, None], 1.0, weighted), 0.0)
    return bags, weights.astype(np.float32)

  # -- numbers -------------------------------------------------------------------------

  def _dense(self, c: Column, array, locate) -> np.ndarray:
    _check_nulls(array, c, locate)
    # A copy: Arrow's buffer, viewed without one, is read-only.
    x = np.array(pc.fill_null(array, np.nan).to_numpy(zero_copy_only=False), np.float64)
    missing = np.isnan(x)
    if missing.any():
      x[missing] = self.means[c.name] if c.default is None else float(c.default)
    if c.transform == schema_lib.LOG1P:
      x = np.log1p(np.maximum(x, 0.0))
    elif c.transform == schema_lib.STANDARDIZE:
      x = (x - self.means[c.name]) / self.stds[c.name]
    return x.astype(np.float32)

  def _label(self, c: Column, array, locate) -> np.ndarray:
    _check_nulls(array, c, locate)
    default = 0.0 if c.default is None else float(c.default)
    y = np.asarray(pc.fill_null(array, default).to_numpy(zero_copy_only=False), np.float64)
    if self.label_threshold is not None:
      y = (y >= self.label_threshold).astype(np.float64)
    return y.astype(np.float32)


def _weight_lists(c: Column, lengths: np.ndarray, table: pa.Table, locate):
  """List column ``c``'s weights (nulls as []), their lengths, and which rows have none.

  Raises:
    DataError: a row's weights are not one per id (``lengths``).
  """
  warr = table.column(c.weights).combine_chunks()
  unweighted = _nulls(warr)  # a row whose weights are null weighs each id 1
  w_lists = pc.fill_null(warr, pa.scalar([], warr.type)) if warr.null_count else warr
  w_len = np.asarray(pc.list_value_length(w_lists).to_numpy(zero_copy_only=False), np.int64)
  bad = (w_len != lengths) & ~unweighted
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise DataError(f"{_where(locate, i)}: column {c.weights!r} holds {w_len[i]} weights "
                    f"for the {lengths[i]} ids of {c.name!r}; give one weight per id.")
  return w_lists, w_len, unweighted


def check(table: pa.Table, schema: Schema, locate=None) -> None:
  """The checks the featurizer makes of each row, which need no statistics.

  A null where the column's policy is ``error`` (a list's elements too), and
  weights that are not one per id, raise ``DataError`` naming the row
  (``locate``) and the column.
  """
  for name in table.column_names:
    c = schema[name]
    array = table.column(name).combine_chunks()
    _check_nulls(array, c, locate)
    if c.role != schema_lib.LIST:
      continue
    lists = pc.fill_null(array, pa.scalar([], array.type)) if array.null_count else array
    values = lists.flatten()
    if values.null_count:
      _check_nulls(values, c, lambda i, lists=lists: _where(locate, _parent(lists, i)),
                   " in a list")
    if c.weights:
      lengths = np.asarray(pc.list_value_length(lists).to_numpy(zero_copy_only=False), np.int64)
      _weight_lists(c, lengths, table, locate)


def _parent(lists, i: int) -> int:
  return int(np.asarray(pc.list_parent_indices(lists))[i])
