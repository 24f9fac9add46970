"""``tabular``: a team's own files (Parquet, CSV / TSV, RecBole), every model from their schema.

Data (``config.data``, read by ``embedlib.tabular``): ``path`` (and
optionally ``eval_path`` / ``test_path``), the label column(s) (``label``,
``label_threshold``), the columns' roles and id kinds (inferred, then the
hints: ``user_id``, ``item_id``, ``timestamp``, ``user_columns``,
``item_columns``, ``dense``, ``ignore``, ``columns``), and the split
(``hash``: ``eval_fraction`` / ``test_fraction``; ``time``:
``split_time`` / ``test_time``; ``files``: an ``eval_path``). The schema
and the training split's statistics are computed once, printed, and saved
in the workdir (``schema.json``, ``statistics.json``): a resumed run, an
export and a served model read them from there, and refuse files whose
columns no longer match.

Models (``embedlib.models.tabular``): ``dlrm``, ``dcn`` / ``dcn_v2`` and
``ranker`` predict the labels (sigmoid cross-entropy; eval: AUC and
log-loss, a label each when there are several); ``two_tower`` learns the
user and item towers from the rows (the positive ones, with a label) with
in-batch negatives, and its eval ranks each eval row's item among the
items of the training rows (recall@K).
"""

from __future__ import annotations

import dataclasses
import logging
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from embedlib import dynamic
from embedlib import metrics
from embedlib import tabular
from embedlib.models import retrieval as retrieval_lib
from embedlib.models import tabular as models_lib
from embedlib.tabular import schema as schema_lib
from embedlib.tabular import split as split_lib
from embedlib.training.tasks import base

RECALL_KS = (10, 50, 100)
log = logging.getLogger("embedlib.train")


def _host(default=None, **kw):
  """A setting only the host reads: left out of the task's equality (the steps' cache key)."""
  return dataclasses.field(default=default, compare=False, **kw)


def _names(value) -> tuple[str, ...]:
  """A config list of column names: a tuple, or one comma-separated string."""
  if isinstance(value, str):
    return tuple(v.strip() for v in value.split(",") if v.strip())
  return tuple(value or ())


def _columns(value) -> dict:
  """``config.data.columns``: ``{column: {field: value}}``, given as a mapping or as JSON text."""
  if isinstance(value, str):
    try:
      value = json.loads(value) if value.strip() else {}
    except ValueError as e:
      base.fail("data.columns", f"{value!r} is not JSON ({e}); give an object of columns, "
                """e.g. --config.data.columns='{"price": {"transform": "log1p"}}'.""")
  if value is None:
    return {}
  if not hasattr(value, "items"):
    base.fail("data.columns", f"{value!r}: give an object of columns, e.g. "
              """'{"price": {"transform": "log1p"}}'.""")
  columns = {}
  for name, fields in value.items():
    if not hasattr(fields, "items"):
      base.fail(f"data.columns.{name}", f"{fields!r}: give the column's fields as an object, "
                """e.g. {"transform": "log1p"}.""")
    columns[name] = dict(fields)
  return columns


def _split(data) -> split_lib.Split:
  kind = data.split if not data.eval_path else split_lib.FILES
  try:
    return split_lib.Split(kind, eval_fraction=float(data.eval_fraction),
                           test_fraction=float(data.test_fraction),
                           split_time=float(data.split_time), test_time=float(data.test_time),
                           seed=int(data.split_seed))
  except schema_lib.SchemaError as e:
    raise base.ConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class TabularTask(base.Task):
  """Training on a table's rows: ``config.task.name = "tabular"`` (module docstring)."""

  name = "tabular"
  model_name: str = "dlrm"
  num_labels: int = 1
  positives_only: bool = False
  #: The item id column (the two towers' loss reads it); set by ``for_workdir``.
  item_column: str = ""
  path: str = _host("")
  eval_path: str = _host("")
  test_path: str = _host("")
  hints: tabular.Hints = _host(tabular.Hints())
  split: split_lib.Split = _host(split_lib.Split())
  fmt: str = _host("auto")
  delimiter: str = _host("")
  separator: str = _host("|")
  label_threshold: float | None = _host(None)
  workers: int = _host(0)
  num_epochs: int = _host(0)
  recall_ks: tuple[int, ...] = _host(RECALL_KS)
  bucket_size: int = _host(models_lib.BUCKET_SIZE)
  # What reading the files found (``for_workdir``), shared by the task's copies.
  found: dict = _host(None, hash=False)

  @classmethod
  def from_config(cls, config) -> TabularTask:
    data, model = config.data, config.model
    if model.name not in models_lib.NAMES:
      base.fail("model.name", f"{model.name!r}; a table's rows train one of "
                f"{models_lib.NAMES}.")
    if not data.path:
      base.fail("data.path", "name your files: a Parquet file, directory or glob, a CSV / "
                "TSV file with a header, or a RecBole .inter file (configs/tabular.py:PATH).")
    labels = _names(data.label)
    if model.name != models_lib.TWO_TOWER and not labels:
      base.fail("data.label", f"config.model.name={model.name!r} predicts a label: name its "
                "column (--config.data.label=clicked; several: a,b).")
    columns = _columns(data.get("columns"))
    hints = tabular.Hints(
        labels=labels, user_id=data.user_id, item_id=data.item_id, timestamp=data.timestamp,
        user_columns=_names(data.user_columns), item_columns=_names(data.item_columns),
        dense=_names(data.dense), ignore=_names(data.ignore), columns=columns)
    threshold = data.get("label_threshold")
    if data.num_epochs < 0:
      base.fail("data.num_epochs", f"must be >= 0 (0: train num_train_steps), got "
                f"{data.num_epochs}.")
    return cls(model_name=model.name, num_labels=max(1, len(labels)),
               positives_only=model.name == models_lib.TWO_TOWER and bool(labels),
               path=data.path, eval_path=data.eval_path, test_path=data.test_path,
               hints=hints, split=_split(data), fmt=data.format, delimiter=data.delimiter,
               separator=data.list_separator,
               label_threshold=None if threshold is None else float(threshold),
               workers=int(data.workers), num_epochs=int(data.num_epochs),
               recall_ks=tuple(config.task.get("recall_ks", RECALL_KS)),
               bucket_size=models_lib.bucket_size(model), found={})

  def check_data(self) -> None:
    for key, path in (("path", self.path), ("eval_path", self.eval_path),
                      ("test_path", self.test_path)):
      if path:
        try:
          tabular.find(path, self.fmt, self.delimiter)
        except tabular.DataError as e:
          base.fail(f"data.{key}", str(e))

  # -- the files, read once a run -------------------------------------------------------

  def for_workdir(self, workdir: str) -> TabularTask:
    """Reads the files (or the schema saved in ``workdir``): the schema and statistics."""
    if self.found.get("workdir") != workdir:
      self._read(workdir)
    item = self.prepared.schema.role_column(schema_lib.ITEM_ID) or ""
    return dataclasses.replace(self, item_column=item)

  def _read(self, workdir: str) -> None:
    saved = workdir if tabular.saved.has(workdir) else None
    if saved:
      log.info("reading %s with the schema and statistics saved in %s (config.data's column "
               "hints are not read again: a new workdir takes new ones)", self.path, saved)
    try:
      prepared = tabular.prepare(
          self.path, self.hints, split=self.split, fmt=self.fmt, delimiter=self.delimiter,
          separator=self.separator, label_threshold=self.label_threshold,
          workers=self.workers, saved=saved)
    except (tabular.DataError, tabular.SchemaError) as e:
      # A hint's error names its own key (config.data.label, config.data.columns.x).
      named = str(e) if str(e).startswith("config.") else f"config.data.path: {e}"
      raise base.ConfigError(named) from None
    if saved is None:  # a new run's dynamic tables, sized on its devices as its workdir keeps them
      prepared = dataclasses.replace(prepared, schema=models_lib.sized(
          prepared.schema, self.bucket_size, jax.device_count()))
    self.found.update(workdir=workdir, prepared=prepared, corpus=None)

  @property
  def prepared(self) -> tabular.Prepared:
    if "prepared" not in self.found:
      raise base.ConfigError("the tabular task reads its files in for_workdir(workdir) "
                             "before anything else; call it first.")
    return self.found["prepared"]

  def save(self, workdir: str) -> None:
    """Writes the schema and statistics into the workdir (process 0)."""
    if jax.process_index() == 0:
      p = self.prepared
      tabular.saved.save(workdir, p.schema, p.statistics)

  def train_rows(self) -> int:
    return int(tabular.stats.from_json(self.prepared.statistics, "statistics")["rows"])

  def describe_data(self) -> str:
    p = self.prepared
    ignored = f"\nnot read: {', '.join(p.ignored)}" if p.ignored else ""
    return (f"{self.path} ({p.files.format}, {len(p.files.paths)} file(s)); "
            f"{self.train_rows()} training rows; schema:\n{p.schema.describe()}{ignored}")

  def data_spec(self):
    return self.prepared.schema

  def _part(self, key: str):
    """The files of ``config.data.<key>`` read with this run's schema and statistics."""
    p = self.prepared
    try:
      files = tabular.find(getattr(self, key), self.fmt, self.delimiter)
      tabular.saved.check_files(files, p.schema, self.separator)
    except tabular.DataError as e:
      base.fail(f"data.{key}", str(e))
    return dataclasses.replace(p, files=files)

  def sources(self, spec, *, batch_size: int, seed: int, eval_batches: int):
    del spec, eval_batches
    share = dict(process_index=jax.process_index(), process_count=jax.process_count())
    p = self.prepared
    train_part = split_lib.ALL if self.split.kind == split_lib.FILES else split_lib.TRAIN
    train = p.source(train_part, batch_size=batch_size, shuffle=True, seed=seed,
                     num_epochs=None, workers=self.workers, **share)
    if self.eval_path:
      evaluation = self._part("eval_path").source(
          split_lib.ALL, batch_size=batch_size, num_epochs=1, pad_last=True, **share)
      _read_through(evaluation, "data.eval_path")
    else:
      evaluation = p.source(split_lib.EVAL, batch_size=batch_size, num_epochs=1,
                            pad_last=True, **share)
    if self.test_path:
      _read_through(self._part("test_path").source(
          split_lib.ALL, batch_size=batch_size, num_epochs=1, pad_last=True, **share),
                    "data.test_path")
    return train, evaluation

  def describe_eval(self, *, batch_size: int, eval_batches: int) -> str:
    del batch_size
    where = self.eval_path or f"{self.path}, split {self.split.describe()}"
    return f"{where}, at most {eval_batches} batches"

  def featurize(self, batch: dict) -> dict:
    """Dynamic columns' raw ids as exact uint32 words; the timestamps stay on the host."""
    schema = self.prepared.schema
    sparse = {k: dynamic.words(v) if schema[k].ids == schema_lib.DYNAMIC else v
              for k, v in batch["sparse"].items()}
    out = {**batch, "sparse": sparse}
    out.pop("timestamp", None)
    return out

  def build_model(self, model_config, spec, mesh, *, batch_size: int, rngs):
    return models_lib.build_tabular(model_config, spec, mesh=mesh, batch_size=batch_size,
                                    rngs=rngs)

  # -- traced ----------------------------------------------------------------------------

  def _row_weights(self, batch):
    weight = batch.get("mask")
    if self.positives_only:
      label = batch["label"] if batch["label"].ndim == 1 else batch["label"][:, 0]
      positive = (label > 0).astype(jnp.float32)  # a positive row: its label is not 0
      weight = positive if weight is None else weight * positive
    return weight

  def loss(self, model, batch):
    if self.model_name == models_lib.TWO_TOWER:
      users, items = model.towers(batch["dense"], batch["sparse"], batch["weights"])
      ids = _item_keys(batch["sparse"][self.item_column])
      return retrieval_lib.in_batch_softmax_loss(
          users, items, ids, temperature=model.temperature(), mesh=model.mesh,
          weights=self._row_weights(batch))
    logits = model(batch["dense"], batch["sparse"], batch["weights"])
    return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()

  def predict(self, model, batch):
    if self.model_name == models_lib.TWO_TOWER:
      return model.towers(batch["dense"], batch["sparse"], batch["weights"])
    return model(batch["dense"], batch["sparse"], batch["weights"])

  # -- eval --------------------------------------------------------------------------------

  def evaluate(self, model, batches, mesh, source) -> dict:
    if self.model_name == models_lib.TWO_TOWER:
      from embedlib.training.tasks import tabular_retrieval  # pylint: disable=g-import-not-at-top

      return tabular_retrieval.recall(self, model, batches, mesh)
    return self._classify(model, batches)

  def _classify(self, model, batches) -> dict:
    from embedlib.training import steps  # pylint: disable=g-import-not-at-top

    labels = [metrics.StreamingMetrics() for _ in range(self.num_labels)]
    for batch in batches:
      logits = steps.eval_step(model, batch, task=self)
      gather = lambda x: multihost_utils.process_allgather(x, tiled=True)
      y, z, mask = gather(batch["label"]), gather(logits), gather(batch["mask"])
      y, z = np.asarray(y).reshape(len(mask), -1), np.asarray(z).reshape(len(mask), -1)
      for k, acc in enumerate(labels):
        acc.update(y[:, k], logits=z[:, k], weights=mask)
    if not labels[0].count:
      raise base.ConfigError("the eval rows yielded no batch; check config.data.eval_path / "
                             "eval_fraction and config.batch_size.")
    names = self.prepared.schema.labels()
    out = {}
    for name, acc in zip(names, labels):
      r = acc.result()
      suffix = "" if len(names) == 1 else f"_{name}"
      out[f"auc{suffix}"], out[f"logloss{suffix}"] = r["auc"], r["logloss"]
    if len(names) > 1:
      out["auc"] = float(np.mean([out[f"auc_{n}"] for n in names]))
    return out

  def test(self, model, eval_source, mesh) -> dict:
    """The test rows' metrics (``test_*``), where the split or ``test_path`` has them."""
    from embedlib import data as data_lib  # pylint: disable=g-import-not-at-top

    if not (self.test_path or self.split.has_test):
      return {}
    share = dict(process_index=jax.process_index(), process_count=jax.process_count())
    batch_size = eval_source.batch_size
    if self.test_path:
      source = self._part("test_path").source(split_lib.ALL, batch_size=batch_size,
                                                 num_epochs=1, pad_last=True, **share)
    else:
      source = self.prepared.source(split_lib.TEST, batch_size=batch_size, num_epochs=1,
                                    pad_last=True, **share)
    batches = (data_lib.to_global_batch(self.featurize(b), mesh) for b in source)
    with dynamic.frozen_maps(model):
      return {f"test_{k}": v for k, v in self.evaluate(model, batches, mesh, source).items()}

  def steps_per_epoch(self, batch_size: int) -> int:
    """Global batches in one pass over the training rows (at least 1)."""
    return max(1, self.train_rows() // batch_size)

  def early_stopping_metric(self) -> tuple[str, bool]:
    if self.model_name == models_lib.TWO_TOWER:
      return f"recall@{min(self.recall_ks)}", True  # the sharpest: a small catalogue fills K
    return "auc", True


def _read_through(source, key: str) -> None:
  """Reads every row of ``source`` once, then rewinds it; a bad value fails naming ``key``.

  The training path's rows are all read for their statistics before a run
  writes its workdir; an eval or test file's are read here, before it too,
  rather than at the first eval or at the end.
  """
  start = source.get_state()
  try:
    for _ in source:
      pass
  except (tabular.DataError, tabular.SchemaError) as e:
    base.fail(key, str(e))
  source.set_state(start)


def _item_keys(ids):
  """One int32 a row telling items apart in the loss (a dynamic column's two words mixed)."""
  if isinstance(ids, dynamic.Words):
    return jax.lax.bitcast_convert_type(ids.hi * jnp.uint32(0x9E3779B1) ^ ids.lo, jnp.int32)
  return ids


__all__ = ["TabularTask"]

