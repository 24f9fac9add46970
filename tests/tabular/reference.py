"""A plain-Python parse of table files and the arrays the documented rules make of its rows.

The readers' tests write small files, parse them back here without the
library (Python's ``csv`` module; pyarrow's rows as Python objects), and
compare what the library's source yields with ``featurize`` of those rows:
ids by the rules the docs give (a vocabulary by count order, a string's
BLAKE2b, hashed rows by ``embedlib.tabular.hashing``), dense transforms,
null policies, list padding and truncation, weights.
"""

import collections
import csv
import datetime
import decimal
import hashlib
import math

import numpy as np
import pyarrow.parquet as pq

from embedlib.tabular import hashing
from embedlib.tabular import schema as S

MISSING = (1 << 60)
PAD = (1 << 64) - 1


# -- parsing -----------------------------------------------------------------------------


def _python(value):
  if isinstance(value, datetime.datetime):
    if value.tzinfo is None:
      value = value.replace(tzinfo=datetime.timezone.utc)
    return value.timestamp()
  if isinstance(value, datetime.date):
    return float((value - datetime.date(1970, 1, 1)).days * 86400)
  if isinstance(value, decimal.Decimal):
    return float(value)
  if isinstance(value, bool):
    return int(value)
  if isinstance(value, list):
    return [_python(v) for v in value]
  return value


def parquet_rows(paths):
  """Every row of the Parquet files, in order, one row group at a time (pyarrow's Python rows)."""
  for path in paths:
    f = pq.ParquetFile(path)
    for g in range(f.num_row_groups):
      for row in f.read_row_group(g).to_pylist():
        yield {k: _python(v) for k, v in row.items()}


def _typed_text(field, column, separator):
  if column.role in (S.LIST, S.WEIGHTS):
    if field == "":
      return None
    kind = float if column.role == S.WEIGHTS else (str if column.dtype == S.STRING else int)
    return [None if v == "" else kind(v) for v in field.split(separator)]
  if field == "":
    return None
  if column.is_id:
    return field if column.dtype == S.STRING else int(field)
  return float(field)


def text_rows(paths, schema, delimiter=",", separator="|", quoting=csv.QUOTE_MINIMAL):
  """Every row of CSV / TSV files (``csv.reader``), typed by ``schema``; names split at ':'."""
  for path in paths:
    with open(path, newline="", encoding="utf-8-sig") as f:
      lines = csv.reader(f, delimiter=delimiter, quoting=quoting)
      header = [h.split(":")[0] for h in next(lines)]
      for line in lines:
        assert len(line) == len(header), (path, line)
        yield {n: _typed_text(v, schema[n], separator) for n, v in zip(header, line)
               if n in schema and schema[n].role != S.IGNORE}


def recbole_rows(inter, user, item, schema):
  """``.inter`` rows (tab-separated, sequences space-separated) joined with ``.user``, ``.item``."""
  def side(path, key):
    rows = list(text_rows([path], schema, "\t", " ", csv.QUOTE_NONE))
    return {r[key]: r for r in rows}

  users, items = side(user, "user_id"), side(item, "item_id")
  user_cols = [n for n in schema.names() if schema[n].entity == "user" and n != "user_id"]
  item_cols = [n for n in schema.names() if schema[n].entity == "item" and n != "item_id"]
  for row in text_rows([inter], schema, "\t", " ", csv.QUOTE_NONE):
    u, i = users.get(row["user_id"], {}), items.get(row["item_id"], {})
    row.update({n: u.get(n) for n in user_cols})
    row.update({n: i.get(n) for n in item_cols})
    yield row


# -- the documented rules ------------------------------------------------------------------


def raw_id(value) -> int:
  """A value's 64-bit id: an int's two's complement; a string's BLAKE2b, first 8 bytes LE."""
  if isinstance(value, str):
    h = int.from_bytes(hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest(), "little")
    return h - 1 if h == (1 << 64) - 1 else h
  return value % (1 << 64)


def vocabulary(column, train_rows) -> dict:
  """value -> id: values of the training rows seen ``min_count`` times, most frequent first."""
  counts = collections.Counter()
  for row in train_rows:
    value = row[column.name]
    for v in (value or []) if column.role == S.LIST else [value]:
      if v is not None:
        counts[v] += 1
  kept = sorted((v for v, n in counts.items() if n >= column.min_count),
                key=lambda v: (-counts[v], str(v)))
  return {v: i + 1 for i, v in enumerate(kept)}


def _default(column, v):
  if v is None and column.default is not None:
    return str(column.default) if column.dtype == S.STRING else int(column.default)
  return v


def _ids(column, values, vocab):
  values = [_default(column, v) for v in values]
  if column.ids == S.VOCAB:
    return np.array([0 if v is None else vocab.get(v, 0) for v in values], np.int32)
  raw = np.array([MISSING if v is None else raw_id(v) for v in values], np.uint64)
  if column.ids == S.HASHED:
    return hashing.hashed_rows(raw, column.name, column.num_embeddings)
  return raw


def moments(column, train_rows):
  x = [r[column.name] for r in train_rows if r[column.name] is not None]
  mean = math.fsum(x) / len(x) if x else 0.0
  std = math.sqrt(math.fsum((v - mean) ** 2 for v in x) / len(x)) if x else 0.0
  return mean, (std if std > 0 else 1.0)


def featurize(rows, schema, train_rows, label_threshold=None) -> dict:
  """The arrays ``Featurizer`` documents, of ``rows``, from their values one by one."""
  rows = list(rows)
  out = {"sparse": {}, "weights": {}}
  for name in schema.features():
    c = schema[name]
    vocab = vocabulary(c, train_rows) if c.ids == S.VOCAB else None
    if c.role != S.LIST:
      out["sparse"][name] = _ids(c, [r[name] for r in rows], vocab)
      continue
    width = c.max_len
    bags, weights = [], []
    for r in rows:
      ids = list(_ids(c, r[name] or [], vocab))[:width]
      pad = PAD if c.ids == S.DYNAMIC else -1
      bags.append(ids + [pad] * (width - len(ids)))
      if c.weights:
        w = r[c.weights]
        w = [1.0] * len(r[name] or []) if w is None else [1.0 if v is None else v for v in w]
        assert len(w) == len(r[name] or []), (name, r)
        weights.append(w[:width] + [0.0] * (width - len(ids)))
    dtype = np.uint64 if c.ids == S.DYNAMIC else np.int32
    out["sparse"][name] = np.array(bags, dtype).reshape(len(rows), width)
    if c.weights:
      out["weights"][name] = np.array(weights, np.float32).reshape(len(rows), width)
  dense = []
  for name in schema.dense():
    c = schema[name]
    mean, std = moments(c, train_rows)
    col = []
    for r in rows:
      x = r[name]
      x = (mean if c.default is None else float(c.default)) if x is None else float(x)
      if c.transform == S.LOG1P:
        x = math.log1p(max(x, 0.0))
      elif c.transform == S.STANDARDIZE:
        x = (x - mean) / std
      col.append(x)
    dense.append(col)
  out["dense"] = np.array(dense, np.float32).T.reshape(len(rows), len(dense))
  labels = schema.labels()
  if labels:
    y = [[float(r[n]) for n in labels] for r in rows]
    if label_threshold is not None:
      y = [[float(v >= label_threshold) for v in r] for r in y]
    y = np.array(y, np.float32)
    out["label"] = y[:, 0] if len(labels) == 1 else y
  ts = schema.role_column(S.TIMESTAMP)
  if ts is not None:
    out["timestamp"] = np.array([r[ts] for r in rows], np.float64)
  return out


def concat(batches) -> dict:
  """The batches' rows as one tree of arrays, padding (``mask`` 0) left out."""
  def join(trees, keep):
    if isinstance(trees[0], dict):
      return {k: join([t[k] for t in trees], keep) for k in trees[0]}
    return np.concatenate(trees)[keep]

  batches = list(batches)
  keep = (np.concatenate([b["mask"] for b in batches]) > 0 if "mask" in batches[0]
          else slice(None))
  return join([{k: v for k, v in b.items() if k != "mask"} for b in batches], keep)


def assert_equal(got, want, *, dense_rtol=0.0):
  """Every array of ``want`` equals ``got``'s (same dtype); dense within ``dense_rtol``."""
  assert set(got) == set(want), (sorted(got), sorted(want))
  for key in ("sparse", "weights"):
    assert set(got[key]) == set(want[key]), key
    for name in want[key]:
      g, w = got[key][name], want[key][name]
      assert g.dtype == w.dtype and g.shape == w.shape, (key, name, g.dtype, g.shape, w.shape)
      np.testing.assert_array_equal(g, w, err_msg=f"{key}[{name!r}]")
  for key in ("label", "timestamp"):
    if key in want:
      assert got[key].dtype == want[key].dtype
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert got["dense"].dtype == np.float32 and got["dense"].shape == want["dense"].shape
  np.testing.assert_allclose(got["dense"], want["dense"], rtol=dense_rtol, atol=dense_rtol)
