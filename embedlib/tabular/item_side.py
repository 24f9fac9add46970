"""Side columns of the items of a RecBole dataset, by the split's dense item ids.

SASRec and HSTU read an item as its id and, with ``config.data.item_columns``,
the columns of its row in the ``.item`` file (``class`` genres,
``release_year``, ``movie_title`` tokens): a ``token`` column is one id, a
``token_seq`` a bag of them. Each column's values get ids ``1 ..`` by how
many items hold them (0: an item with no row or no value); a bag keeps at
most ``MAX_LEN`` ids. The file is read as ``recbole`` reads an ``.item`` file.

>>> import os, tempfile
>>> d = tempfile.mkdtemp(); path = os.path.join(d, "x.item")
>>> _ = open(path, "w").write("item_id:token\\tclass:token_seq\\n7\\tA B\\n9\\tB\\n")
>>> side = read(path, ("class",), raw_item_ids=["-1", "9", "7", "5"])
>>> side["class"].tolist()   # items 0 (padding), 9, 7 and 5 (no row); B (id 1) is commoner
[[-1, -1], [1, -1], [2, 1], [-1, -1]]
"""

from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embedlib.tabular import files as files_lib
from embedlib.tabular import readers, recbole
from embedlib.tabular import schema as schema_lib

#: Most ids a ``token_seq`` column keeps an item.
MAX_LEN = 16


def read(path: str, names, raw_item_ids) -> dict[str, np.ndarray]:
  """``{column: int32 [num_items + 1, bag]}`` of ``names`` (ids from 1, -1 padding).

  Args:
    path: the dataset's ``.item`` file.
    names: its columns to read.
    raw_item_ids: the split's file id of each dense item (entry 0: padding).

  Raises:
    ValueError: a column the file lacks, or one of floats.
  """
  header = files_lib.read_header(path, "\t")
  types = dict(recbole.header_types(path, header))
  columns = [schema_lib.Column("item_id", schema_lib.CATEGORICAL, schema_lib.STRING)]
  for name in names:
    if name not in types or name == "item_id":
      raise ValueError(f"config.data.item_columns: {path} has no item column {name!r}; its "
                       f"columns are {sorted(n for n in types if n != 'item_id')}.")
    if types[name] not in ("token", "token_seq"):
      raise ValueError(f"config.data.item_columns: {name!r} is {types[name]} in {path}; the "
                       "sequence models read token and token_seq columns.")
    role = schema_lib.LIST if types[name] == "token_seq" else schema_lib.CATEGORICAL
    columns.append(schema_lib.Column(name, role, schema_lib.STRING))
  schema = schema_lib.Schema(tuple(columns))
  files = files_lib.Files(files_lib.RECBOLE, (path,), "\t", header)
  table = pa.concat_tables(readers.read_text(c, schema, files, recbole.SEQ_SEPARATOR)
                           for c in files_lib.text_chunks(path, 0))
  # The split's dense item d is the file's row index_of[d] (-1: no row).
  keys = pa.array([str(r) for r in raw_item_ids], pa.string())
  index_of = pc.fill_null(pc.index_in(keys, value_set=table.column("item_id")), -1)
  index_of = np.asarray(index_of.to_numpy(zero_copy_only=False), np.int64)
  index_of[0] = -1
  out = {}
  for name in names:
    values = table.column(name).combine_chunks().to_pylist()
    bags = [[] if v is None else (v if isinstance(v, list) else [v]) for v in values]
    bags = [[x for x in b if x is not None][:MAX_LEN] for b in bags]
    counts = collections.Counter(x for b in bags for x in set(b))
    ids = {v: i + 1 for i, (v, _) in enumerate(sorted(counts.items(),
                                                        key=lambda vn: (-vn[1], vn[0])))}
    width = max(1, max((len(b) for b in bags), default=1))
    rows = np.full((len(index_of), width), -1, np.int32)
    for d, r in enumerate(index_of):
      if r >= 0:
        bag = [ids[x] for x in bags[r]]
        rows[d, :len(bag)] = bag
    out[name] = rows
  return out


def vocab_sizes(side: dict[str, np.ndarray]) -> dict[str, int]:
  """Rows of each column's table: its largest id plus one (0 is unused: ids start at 1)."""
  return {name: int(max(rows.max(), 0)) + 1 for name, rows in side.items()}
