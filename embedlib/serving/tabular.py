"""A tabular run's artifact scoring files and named columns as the run read them.

The artifact's manifest carries the run's schema and statistics
(``data.schema``, ``data.statistics``); ``embedlib.tabular`` (numpy and
pyarrow, no model code) turns a file's rows, or columns given by name,
into the program's inputs exactly as training did: the same vocabularies,
hashes (a string id's 64-bit value, ``embedlib.tabular.hashing``), null
policies and transforms.

    model = serving.load("artifact/")
    for scores in serving.tabular.score_file(model, "new_clicks.parquet"):
      ...                                    # {"probability": [rows]}, in file order
    serving.tabular.score_columns(model, {"user_id": ["alice"], "item_id": [7], ...})
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import pyarrow as pa

from embedlib import tabular
from embedlib.serving.model import InputError, ServedModel
from embedlib.tabular import readers
from embedlib.tabular import schema as schema_lib

#: A weighted list's weights input (``embedlib.training.scoring.WEIGHTS_SUFFIX``).
WEIGHTS_SUFFIX = ":weights"


def _data(model: ServedModel) -> dict:
  data = model.manifest.get("data", {})
  if data.get("source") != "tabular":
    raise InputError(f"{model.directory} is a {model.task} artifact of a "
                     f"{data.get('source')!r} run; files and named columns are scored by "
                     "artifacts of runs on your own files (configs/tabular.py).")
  return data


def schema_of(model: ServedModel) -> tuple[tabular.Schema, dict]:
  """The run's schema and statistics, as its artifact carries them."""
  import json  # pylint: disable=g-import-not-at-top

  data = _data(model)
  schema = tabular.Schema.from_json(json.dumps(data["schema"]),
                                    where=f"{model.directory}/manifest.json")
  return schema, data["statistics"]


def program_inputs(model: ServedModel, arrays: dict) -> dict:
  """The program's named inputs of ``Featurizer`` arrays."""
  inputs = {"dense": arrays["dense"]}
  for name, ids in arrays["sparse"].items():
    inputs[name] = ids
  for name, weights in arrays.get("weights", {}).items():
    inputs[name + WEIGHTS_SUFFIX] = weights
  return inputs


def score_file(model: ServedModel, path: str) -> Iterator[dict]:
  """The outputs of every row of ``path`` (the run's kinds of files), in order, in batches.

  The label columns may be absent. Memory holds a few chunks of the file.

  Raises:
    DataError: the file's columns no longer match the run's (naming it).
  """
  data = _data(model)
  schema, statistics = schema_of(model)
  prepared = tabular.dataset.with_schema(
      path, schema, statistics, fmt="auto", delimiter=data.get("delimiter", ""),
      separator=data.get("list_separator", readers.LIST_SEPARATOR), need_labels=False)
  source = prepared.source(tabular.split.ALL, batch_size=model.batch_size, num_epochs=1,
                           pad_last=True)
  for batch in source:
    keep = batch["mask"] > 0
    out = model(program_inputs(model, batch))
    yield {k: v[keep] for k, v in out.items()}


def score_columns(model: ServedModel, columns: Mapping) -> dict:
  """The outputs of rows given as named columns: ``{name: [values]}`` (strings, ints, lists).

  Every column the run reads but its labels must be given; a value is read
  as it would be in a file (a null is ``None``).

  Raises:
    InputError: a column is missing or holds a value its type can't take.
  """
  schema, statistics = schema_of(model)
  wanted = [c for c in schema.columns if c.role not in (schema_lib.IGNORE, schema_lib.LABEL)]
  missing = [c.name for c in wanted if c.name not in columns]
  if missing:
    raise InputError(f"the column {missing[0]!r} is missing; the artifact reads "
                     f"{', '.join(c.name for c in wanted)} (its run's schema).")
  arrays = {}
  for c in wanted:
    try:
      array = pa.array(list(columns[c.name]))
      if pa.types.is_null(array.type):  # every value None
        array = pa.nulls(len(array), readers.arrow_type(c))
      arrays[c.name] = readers.conform(array, c, "the input")
    except (pa.ArrowInvalid, pa.ArrowTypeError, tabular.DataError) as e:
      raise InputError(f"column {c.name!r}: {e}") from None
  rows = {len(a) for a in arrays.values()}
  if len(rows) > 1:
    raise InputError(f"the columns have different numbers of rows {sorted(rows)}; pass as "
                     "many values in each.")
  scoring = schema
  for c in schema.columns:
    if c.role == schema_lib.LABEL:
      scoring = scoring.replace(c.name, role=schema_lib.IGNORE)
  featurizer = tabular.Featurizer(scoring, statistics)
  out = model(program_inputs(model, featurizer(pa.table(arrays))))
  return {k: np.asarray(v) for k, v in out.items()}
