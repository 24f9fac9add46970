"""Small click logs written as Parquet and CSV / TSV files, for the tabular tests."""

import csv
import datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embedlib.tabular import Hints

#: The click log's columns and what the readers' tests declare about them.
HINTS = Hints(
    labels=("clicked",), dense=("hour",), ignore=("note",),
    columns={
        "user_id": {"ids": "dynamic"},
        "item_id": {"ids": "vocab", "min_count": 2},
        "device": {"ids": "hashed", "num_embeddings": 7, "default": "unknown"},
        "categories": {"max_len": 3},
        "tags": {"ids": "dynamic"},
        "hour": {"transform": "log1p"},
    })
T0 = 1_700_000_000


def click_rows(n: int, seed: int = 0) -> list[dict]:
  """``n`` rows of a click log: string users, int items, lists with weights, nulls everywhere."""
  rng = np.random.default_rng(seed)
  users = [f"u{k}" for k in range(12)] + ["ü", "u,7"]
  items = [5, 6, 7, 8, -3, 2**40, 11, 12, 13]
  tags = ["red", "green", "blue", "x y"]
  rows = []
  for i in range(n):
    k = int(rng.integers(0, 6))
    cats = [int(c) for c in rng.integers(0, 9, k)]
    if k and i % 7 == 3:
      cats[0] = None
    tag = [str(t) for t in rng.choice(tags, int(rng.integers(0, 4)))]
    weights = [float(w) for w in rng.choice([0.5, 1.25, 2.0], len(tag))]
    if weights and i % 5 == 1:
      weights[-1] = None
    rows.append({
        "user_id": None if i % 17 == 5 else users[int(rng.integers(0, len(users)))],
        "item_id": None if i % 19 == 4 else items[min(int(rng.zipf(1.6)) - 1, len(items) - 1)],
        "categories": None if i % 11 == 2 else cats,
        "tags": tag,
        "tags_weight": None if i % 9 == 8 else weights,
        "price": None if i % 4 == 0 else float(np.round(rng.uniform(0.5, 90.0), 2)),
        "hour": int(rng.integers(0, 24)),
        "device": None if i % 13 == 6 else ["ios", "android", "web"][int(rng.integers(0, 3))],
        "note": "hello, world" if i % 3 else "plain",
        "clicked": int(rng.random() < 0.3),
        "timestamp": T0 + 60 * i + int(rng.integers(0, 60)),
    })
  return rows


def arrow_table(rows, *, variant: int = 0) -> pa.Table:
  """The rows as Arrow columns; ``variant`` 1 gives other, equally readable types."""
  col = lambda name: [r[name] for r in rows]  # noqa: E731
  stamps = [datetime.datetime.fromtimestamp(t, datetime.timezone.utc).replace(tzinfo=None)
            for t in col("timestamp")]
  return pa.table({
      "user_id": pa.array(col("user_id"), pa.large_string() if variant else pa.string()),
      "item_id": pa.array(col("item_id"), pa.int64()),
      "categories": pa.array(col("categories"), pa.list_(pa.int32())),
      "tags": pa.array(col("tags"), pa.large_list(pa.string()) if variant
                       else pa.list_(pa.string())),
      "tags_weight": pa.array(col("tags_weight"), pa.list_(pa.float32())),
      "price": pa.array(col("price"), pa.float64()),
      "hour": pa.array(col("hour"), pa.int16() if variant else pa.int8()),
      "device": (pa.array(col("device")).dictionary_encode() if variant
                 else pa.array(col("device"))),
      "note": pa.array(col("note")),
      "clicked": pa.array([bool(v) for v in col("clicked")]),
      "timestamp": pa.array(stamps, pa.timestamp("s")),
  })


def write_parquet(path, rows, *, row_group_size: int = 8, variant: int = 0) -> str:
  pq.write_table(arrow_table(rows, variant=variant), str(path), row_group_size=row_group_size)
  return str(path)


def _field(value, separator):
  if value is None:
    return ""
  if isinstance(value, list):
    return separator.join("" if v is None else repr(v) if isinstance(v, float) else str(v)
                          for v in value)
  return repr(value) if isinstance(value, float) else str(value)


def write_text(path, rows, *, delimiter: str = ",", separator: str = "|", columns=None,
               encoding: str = "utf-8", end: str = "\n") -> str:
  """The rows as a text file with a header line (Python's ``csv`` writer)."""
  columns = list(columns or rows[0])
  with open(path, "w", newline="", encoding=encoding) as f:
    w = csv.writer(f, delimiter=delimiter, lineterminator=end)
    w.writerow(columns)
    for r in rows:
      w.writerow([_field(r[c], separator) for c in columns])
  return str(path)
