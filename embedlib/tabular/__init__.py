"""Your own logs as training data: typed schemas for Parquet, CSV / TSV and RecBole files.

A path's rows as batches::

    from embedlib import tabular
    data = tabular.prepare("clicks/", tabular.Hints(labels=("clicked",)),
                           split=tabular.Split("hash", eval_fraction=0.1))
    print(data.schema.describe())
    batch = next(data.source("train", batch_size=1024, shuffle=True))

- ``schema``: a column's role (categorical, categorical list, dense,
  label, user / item id, timestamp, weights), value type, id handling
  (dynamic, hashed, vocabulary) and null policy; JSON on disk.
- ``infer``: a schema from the files' own types (Arrow, RecBole's header, a
  CSV sample), corrected by ``Hints`` (what the user declares).
- ``files`` and ``readers``: which files a path names, and one chunk (a
  Parquet row group, lines of a text file) read as the schema's typed
  columns; ``recbole``: ``.inter`` rows joined with ``.user`` / ``.item``;
  ``item_side``: an ``.item`` file's columns by item, for SASRec and HSTU.
- ``stats``: the training split's vocabularies, means and list lengths.
- ``featurize``: typed columns to ids, bags, weights, dense and labels: the
  one place a value becomes an id (``hashing``: the 64-bit id of a string).
- ``split``: hash holdout and time split. ``source``: resumable batches,
  sharded over processes, read by grain workers. ``saved``: a run's schema
  and statistics in its workdir.

Needs numpy and pyarrow (and grain for workers), not jax: a served model
reads its inputs with it.
"""

from embedlib.tabular.dataset import Prepared, prepare
from embedlib.tabular.featurize import Featurizer
from embedlib.tabular.files import DataError, Files, find
from embedlib.tabular.infer import Hints
from embedlib.tabular.schema import Column, Schema, SchemaError
from embedlib.tabular.source import Reading, TabularSource
from embedlib.tabular.split import Split

__all__ = ["Column", "DataError", "Featurizer", "Files", "Hints", "Prepared", "Reading",
           "Schema", "SchemaError", "Split", "TabularSource", "find", "prepare"]
