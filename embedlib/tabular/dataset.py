"""A path of files made ready to read: its schema resolved, its statistics computed.

    data = tabular.prepare("logs/", tabular.Hints(labels=("clicked",)))
    print(data.schema.describe())
    train = data.source("train", batch_size=1024, shuffle=True)
    batch = next(train)        # featurize's arrays, this process's rows

``prepare`` finds the files, infers the schema (or takes a saved one, and
refuses files that no longer match it), reads every row once to check it
and to compute the training split's statistics, and resolves each ``auto``
id column. A saved run's schema and statistics are used as they are:
``prepare(path, saved=workdir)``.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from embedlib.tabular import files as files_lib
from embedlib.tabular import infer as infer_lib
from embedlib.tabular import readers
from embedlib.tabular import saved as saved_lib
from embedlib.tabular import split as split_lib
from embedlib.tabular import stats as stats_lib
from embedlib.tabular.featurize import Featurizer
from embedlib.tabular.files import Files
from embedlib.tabular.schema import Schema
from embedlib.tabular.source import Reading, TabularSource, compute_statistics

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prepared:
  """Files with their resolved schema and statistics (``prepare``).

  Attributes:
    files: the path's files.
    schema: every column's kind and size decided.
    statistics: ``Statistics.to_json``'s text (saved as it is).
    featurizer: values to arrays, by the schema and statistics.
    split: how the rows are parted.
    separator: a CSV list column's separator.
    label_threshold: labels ``>=`` it read 1 (None: as they are).
    ignored: columns in the files that the schema does not read.
  """

  files: Files
  schema: Schema
  statistics: str
  featurizer: Featurizer
  split: split_lib.Split
  separator: str
  label_threshold: float | None
  ignored: tuple[str, ...] = ()

  def reading(self, part: str, *, shuffle: bool = False, seed: int = 0,
              process_index: int = 0, process_count: int = 1) -> Reading:
    return Reading(self.files, tuple(files_lib.chunks(self.files)), self.schema, self.split,
                   part, self.separator, process_index, process_count, shuffle, seed)

  def source(self, part: str, *, batch_size: int, shuffle: bool = False, seed: int = 0,
             num_epochs: int | None = None, workers: int = 0, pad_last: bool = False,
             process_index: int = 0, process_count: int = 1) -> TabularSource:
    """Batches of ``part`` (``train``, ``eval``, ``test`` or ``all``) of this process's rows."""
    reading = self.reading(part, shuffle=shuffle, seed=seed, process_index=process_index,
                           process_count=process_count)
    return TabularSource(reading, self.featurizer, batch_size=batch_size,
                         num_epochs=num_epochs, workers=workers, pad_last=pad_last)


def prepare(path: str, hints: infer_lib.Hints = infer_lib.Hints(), *,
            split: split_lib.Split = split_lib.Split(split_lib.FILES), fmt: str = "auto",
            delimiter: str = "", separator: str = readers.LIST_SEPARATOR,
            label_threshold: float | None = None, workers: int = 0, saved: str | None = None,
            need_labels: bool = True) -> Prepared:
  """``path``'s files, schema and statistics (see the module docstring).

  Args:
    path: a Parquet file, directory or glob; a CSV / TSV file; a RecBole
      ``.inter`` file.
    hints: what the user declares (``infer.Hints``); unused with ``saved``.
    split: how rows part into train, eval and test; the statistics are the
      training rows'.
    fmt: ``auto``, ``parquet``, ``csv`` or ``recbole``.
    delimiter: a CSV file's field separator ("": ``,``, or tab for .tsv).
    separator: a CSV list column's value separator.
    label_threshold: labels ``>=`` it read 1, below it 0.
    workers: grain worker processes for the statistics pass.
    saved: a directory holding a run's ``schema.json`` and
      ``statistics.json``: those are used (the files checked against them).
    need_labels: False for files to score, which may lack the labels.

  Raises:
    DataError, SchemaError: naming the file, row and column, and the fix.
  """
  if saved is not None:
    schema, statistics = saved_lib.load(saved)
    return with_schema(path, schema, statistics, split=split, fmt=fmt, delimiter=delimiter,
                       separator=separator, label_threshold=label_threshold,
                       need_labels=need_labels)
  files = files_lib.find(path, fmt, delimiter)
  schema = infer_lib.infer(files, hints, separator)
  ignored = saved_lib.check_files(files, schema, separator, saved=False)
  reading = Reading(files, tuple(files_lib.chunks(files)), schema, split, split_lib.TRAIN,
                    separator)
  log.info("reading %s once for its statistics (%d chunk(s)) ...", path, len(reading.chunks))
  stats = compute_statistics(reading, label_threshold=label_threshold, workers=workers)
  if not stats.rows:
    raise files_lib.DataError(f"{path}: no row falls in the training split "
                              f"({split.describe()}); change the split.")
  resolved = stats_lib.resolve(schema, stats)
  text = stats.to_json(resolved)
  return Prepared(files, resolved, text, Featurizer(resolved, stats_lib.from_json(text, path),
                                                     label_threshold), split, separator,
                  label_threshold, tuple(ignored))


def with_schema(path: str, schema: Schema, statistics: dict, *,
                split: split_lib.Split = split_lib.Split(split_lib.FILES), fmt: str = "auto",
                delimiter: str = "", separator: str = readers.LIST_SEPARATOR,
                label_threshold: float | None = None, need_labels: bool = True) -> Prepared:
  """``path``'s files read with a run's schema and statistics (a workdir's, an artifact's).

  Raises:
    DataError: the files' columns no longer match the schema (naming the column).
  """
  files = files_lib.find(path, fmt, delimiter)
  if not need_labels:
    schema = saved_lib.without_absent_labels(files, schema, separator)
  ignored = saved_lib.check_files(files, schema, separator, need_labels=need_labels)
  return Prepared(files, schema, json.dumps(statistics), Featurizer(
      schema, statistics, label_threshold), split, separator, label_threshold, tuple(ignored))
