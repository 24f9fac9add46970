"""A click log of the kind a team's own logs are, with a planted label: for tests and benchmarks.

    python -m embedlib.tabular.synth OUT_DIR --rows 1000000 --files 8 [--format parquet|csv]

Columns: ``user_id`` (string, ``"u<n>"``), ``item_id`` (int64),
``categories`` (a list of 1 to 4 int ids, the item's), ``price`` (float,
10% null), ``hour`` (int 0..23), ``device`` (string, 3 values), five more
dense columns ``d0 .. d4`` (floats, 5% null each), ``timestamp`` (int
seconds, increasing) and ``clicked`` (0/1). The click is drawn from a
hidden logistic model of the user, the item, its categories, the hour and
``d0``; everything is a function of the seed and the row number, so files
written in parts, or by several processes, are the same rows.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from embedlib.data import _hashing

DEVICES = ("ios", "android", "web")


def rows(first: int, count: int, *, users: int = 100_000, items: int = 20_000,
         seed: int = 0) -> dict:
  """Rows ``first .. first + count - 1`` of the log, as numpy columns (lists as lists)."""
  index = np.arange(first, first + count, dtype=np.uint64)

  def draw(tag: str, n: int = 1) -> np.ndarray:
    key = _hashing.derive_key("tabular-synth", seed, tag)
    bits = _hashing.hash_u64(key, index[:, None] * np.uint64(8) + np.arange(n, dtype=np.uint64))
    return _hashing.uniform(bits)

  user = np.minimum((draw("user")[:, 0] ** 2 * users).astype(np.int64), users - 1)
  item = np.minimum((draw("item")[:, 0] ** 3 * items).astype(np.int64), items - 1)
  item_key = _hashing.derive_key("tabular-synth-item", seed)
  item_bits = _hashing.hash_u64(item_key, item.astype(np.uint64))
  n_cat = 1 + (item_bits % np.uint64(4)).astype(np.int64)
  cats = [(((item_bits >> np.uint64(8 * (k + 1))) % np.uint64(50)).astype(np.int64))
          for k in range(4)]
  categories = [[int(cats[k][r]) for k in range(n_cat[r])] for r in range(count)]
  hour = (draw("hour")[:, 0] * 24).astype(np.int64)
  device = np.array(DEVICES, dtype=object)[(draw("device")[:, 0] * 3).astype(np.int64)]
  dense = _hashing.normal(_hashing.hash_u64(_hashing.derive_key("tabular-synth-d", seed),
                                            index[:, None] * np.uint64(8) +
                                            np.arange(5, dtype=np.uint64)))
  price = np.exp(1.0 + dense[:, 0] * 0.5 + (item % 7))
  user_bias = _hashing.normal(_hashing.hash_u64(_hashing.derive_key("ub", seed),
                                                user.astype(np.uint64)))
  item_bias = _hashing.normal(item_bits)
  logit = (0.8 * user_bias + 0.8 * item_bias + 0.6 * (cats[0] % 2 == 0) - 0.3
           + 0.5 * np.sin(hour / 24 * 2 * np.pi) + 0.7 * dense[:, 1])
  clicked = (draw("click")[:, 0] < 1 / (1 + np.exp(-logit))).astype(np.int64)
  price_null = draw("price-null")[:, 0] < 0.1
  dense_null = draw("dense-null", 5) < 0.05
  return {
      "user_id": np.array([f"u{u}" for u in user], dtype=object),
      "item_id": item,
      "categories": categories,
      "price": np.where(price_null, np.nan, price),
      "hour": hour,
      "device": device,
      **{f"d{k}": np.where(dense_null[:, k], np.nan, dense[:, k]) for k in range(5)},
      "timestamp": 1_600_000_000 + np.arange(first, first + count, dtype=np.int64) * 7,
      "clicked": clicked,
  }


def _arrow(columns: dict):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top

  out = {}
  for name, values in columns.items():
    if name in ("price",) or name.startswith("d") and name != "device":
      out[name] = pa.array(values, pa.float64(), from_pandas=True)
    elif name == "categories":
      out[name] = pa.array(values, pa.list_(pa.int64()))
    elif name in ("user_id", "device"):
      out[name] = pa.array(values.tolist(), pa.string())
    else:
      out[name] = pa.array(values, pa.int64())
  return pa.table(out)


def write(directory: str, *, rows_total: int, files: int, fmt: str = "parquet",
          row_group: int = 65_536, seed: int = 0, **kw) -> list[str]:
  """Writes the log as ``files`` files in ``directory``; returns their paths."""
  os.makedirs(directory, exist_ok=True)
  per = -(-rows_total // files)
  paths = []
  for f in range(files):
    first, count = f * per, min(per, rows_total - f * per)
    if count <= 0:
      break
    path = os.path.join(directory, f"part-{f:05d}.{'parquet' if fmt == 'parquet' else 'csv'}")
    if fmt == "parquet":
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

      with pq.ParquetWriter(path, _arrow(rows(0, 1, seed=seed, **kw)).schema) as writer:
        for start in range(first, first + count, row_group):
          n = min(row_group, first + count - start)
          writer.write_table(_arrow(rows(start, n, seed=seed, **kw)), row_group_size=row_group)
    else:
      _write_csv(path, first, count, row_group, seed, kw)
    paths.append(path)
  return paths


def _write_csv(path, first, count, block, seed, kw) -> None:
  with open(path, "w", encoding="utf-8") as f:
    names = None
    for start in range(first, first + count, block):
      n = min(block, first + count - start)
      cols = rows(start, n, seed=seed, **kw)
      if names is None:
        names = list(cols)
        f.write(",".join(names) + "\n")
      for r in range(n):
        fields = []
        for name in names:
          v = cols[name][r]
          if name == "categories":
            fields.append("|".join(str(x) for x in v))
          elif isinstance(v, float) and np.isnan(v):
            fields.append("")
          else:
            fields.append(str(v))
        f.write(",".join(fields) + "\n")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out")
  parser.add_argument("--rows", type=int, default=1_000_000)
  parser.add_argument("--files", type=int, default=8)
  parser.add_argument("--format", choices=("parquet", "csv"), default="parquet")
  parser.add_argument("--row-group", type=int, default=65_536)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  paths = write(args.out, rows_total=args.rows, files=args.files, fmt=args.format,
                row_group=args.row_group, seed=args.seed)
  print(f"wrote {args.rows} rows in {len(paths)} files under {args.out}")


if __name__ == "__main__":
  main()
