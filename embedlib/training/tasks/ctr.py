"""``ctr``: one binary click label per example (DLRM, DCN-v2).

Batches are ``embedlib.data.spec``'s (``dense``, ``sparse``, ``label``), from
the planted synthetic source or Criteo TSV files; the loss is sigmoid
cross-entropy; an eval reports AUC and log-loss, and the planted source's
``oracle_auc``.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax.experimental import multihost_utils

from embedlib import data as data_lib
from embedlib.data import criteo_binary
from embedlib import dynamic
from embedlib import metrics
from embedlib.models import factory
from embedlib.training import steps
from embedlib.training.tasks import base

SOURCES = ("synthetic", "criteo")
FORMATS = ("tsv", "binary")


def _first_batch_or_fail(source, key: str, what: str, batch_size: int) -> None:
  """Reads one batch and rewinds, so a file without a batch fails before training."""
  state = source.get_state()
  try:
    next(source)
  except StopIteration:
    raise base.ConfigError(
        f"config.{key}: {what} holds fewer than batch_size={batch_size} valid lines, not "
        "one batch. Pass more data or a smaller --config.batch_size.") from None
  source.set_state(state)


def _host(default):
  """A setting only the host reads: left out of the task's equality (the steps' cache key)."""
  return dataclasses.field(default=default, compare=False)


@dataclasses.dataclass(frozen=True)
class CTRTask(base.Task):
  """Binary click-through prediction: ``config.task.name = "ctr"``.

  ``CTRTask()`` is the task of any click model called as ``model(dense,
  sparse)``; ``from_config`` adds the data settings (``config.data``), which
  only its host methods read.
  """

  name = "ctr"
  source: str = _host("synthetic")
  table_sizes: tuple[int, ...] = _host(())
  num_dense: int = _host(0)
  bag_sizes: tuple[int, ...] = _host(())
  zipf_exponent: float = _host(1.0)
  signal_scale: float = _host(1.0)
  train_path: str = _host("")
  eval_path: str = _host("")
  eval_holdout: float = _host(0.0)
  max_bad_lines: int = _host(0)
  raw_ids: bool = _host(False)
  data_format: str = _host("tsv")
  workers: int = _host(0)

  @classmethod
  def from_config(cls, config) -> CTRTask:
    data = config.data
    if data.source not in SOURCES:
      base.fail("data.source", f"{data.source!r}; the ctr task reads one of {SOURCES}.")
    if data.max_bad_lines < -1:
      base.fail("data.max_bad_lines", "must be >= 0, or -1 to skip every malformed line; "
                f"got {data.max_bad_lines}.")
    if not 0.0 <= data.eval_holdout < 1.0:
      base.fail("data.eval_holdout", f"must be a fraction in [0, 1); got {data.eval_holdout}.")
    data_format, workers = data.get("format", "tsv"), int(data.get("workers", 0))
    if data_format not in FORMATS:
      base.fail("data.format", f"{data_format!r}; the criteo source reads one of {FORMATS} "
                "('binary': a directory written by python -m embedlib.data.criteo_binary).")
    if data.source != "criteo" and (workers or data_format != "tsv"):
      base.fail("data.workers" if workers else "data.format", f"the {data.source} source "
                "makes its batches in this process; data.format and data.workers are the "
                "criteo source's: leave them at 'tsv' and 0.")
    if workers < 0 or (workers and data_format != "tsv"):
      base.fail("data.workers", f"{workers}: parsing TSV takes 0 (in this process) or more "
                "worker processes; the binary format needs none (leave it at 0).")
    if data.source != "criteo" and data.eval_holdout:
      base.fail("data.eval_holdout", f"the {data.source} source has its own eval stream; "
                "leave eval_holdout at 0.")
    made = cls(source=data.source, table_sizes=tuple(data.table_sizes),
               num_dense=data.num_dense, bag_sizes=tuple(data.bag_sizes),
               zipf_exponent=data.zipf_exponent, signal_scale=data.signal_scale,
               train_path=data.train_path, eval_path=data.eval_path,
               eval_holdout=data.eval_holdout, max_bad_lines=data.max_bad_lines,
               raw_ids=bool(data.get("raw_ids", False)), data_format=data_format,
               workers=workers)
    if made.raw_ids:
      made._check_raw_ids(config)
    return made

  def _check_raw_ids(self, config) -> None:
    """Raw ids need dynamic tables that can be built."""
    if config.model.name not in ("dlrm", "dcn"):
      base.fail("data.raw_ids", f"config.model.name={config.model.name!r} has no dynamic "
                "tables; raw ids train dlrm or dcn. Set config.data.raw_ids=False.")
    try:
      factory.dynamic_tables(config.model, self.data_spec())
    except ValueError as e:
      raise base.ConfigError(str(e)) from None

  def check_data(self) -> None:
    if self.source != "criteo":
      return
    if bool(self.eval_path) == bool(self.eval_holdout):
      base.fail("data.eval_path", "the criteo source evaluates on a file of its own "
                "(data.eval_path) or on a held-out fraction of the training lines "
                "(data.eval_holdout, e.g. 0.05): set exactly one, "
                f"got eval_path={self.eval_path!r} and eval_holdout={self.eval_holdout}.")
    for key, path in (("train_path", self.train_path), ("eval_path", self.eval_path)):
      if key == "train_path" and not path:
        base.fail(f"data.{key}", "the criteo source needs a path to a Criteo TSV file.")
      if path and self.data_format == "binary":
        try:
          criteo_binary.read_meta(path)
        except (OSError, ValueError) as e:
          base.fail(f"data.{key}", f"{e} (config.data.format='binary')")
        continue
      if path and self.workers and path.endswith(".gz"):
        base.fail("data.workers", f"{self.workers} worker processes read plain TSV by byte "
                  f"ranges, and {path} is gzip: gunzip it, convert it once (python -m "
                  "embedlib.data.criteo_binary, then config.data.format='binary'), or set "
                  "config.data.workers=0.")
      if path and os.path.isdir(path):
        base.fail(f"data.{key}", f"{path!r} is a directory; pass the path of a .tsv or "
                  ".tsv.gz file in it, or set config.data.format='binary' if it was written by "
                  "python -m embedlib.data.criteo_binary.")
      if path and not os.path.isfile(path):
        base.fail(f"data.{key}", f"{path!r} does not exist; pass an existing .tsv or "
                  ".tsv.gz file in the Criteo layout.")

  def data_spec(self) -> data_lib.DataSpec:
    try:
      if self.source == "criteo":
        return data_lib.criteo_spec(list(self.table_sizes) or 100_000)
      return data_lib.DataSpec.from_sizes(self.num_dense, list(self.table_sizes),
                                          bag_sizes=list(self.bag_sizes) or None)
    except ValueError as e:
      raise base.ConfigError(f"config.data.table_sizes / bag_sizes: {e}") from None

  def describe_eval(self, *, batch_size: int, eval_batches: int) -> str:
    del batch_size
    if self.source != "criteo":
      return (f"the {self.source} source's eval stream ({eval_batches} batches, drawn "
              "apart from the training stream)")
    if self.eval_holdout:
      return (f"a held-out {self.eval_holdout:.1%} of the lines of {self.train_path} (chosen "
              f"by a hash of the line number; training skips them), at most "
              f"{eval_batches} batches")
    return f"{self.eval_path}, at most {eval_batches} batches"

  def sources(self, spec, *, batch_size: int, seed: int, eval_batches: int):
    share = dict(process_index=jax.process_index(), process_count=jax.process_count())
    if self.source == "criteo":
      kw = dict(batch_size=batch_size, **share, raw_ids=self.raw_ids)
      if self.data_format == "binary":
        reader = criteo_binary.CriteoBinaryReader
      else:  # only the training stream is long enough to pay for starting workers
        reader = data_lib.CriteoReader
        kw["max_bad_lines"] = None if self.max_bad_lines == -1 else self.max_bad_lines
      train_kw = dict(num_epochs=None, holdout=self.eval_holdout, split="train", **kw)
      try:
        train = reader(self.train_path, spec, **train_kw)
        if self.eval_holdout:
          evaluation = reader(self.train_path, spec, num_epochs=1, holdout=self.eval_holdout,
                              split="holdout", **kw)
          eval_key, eval_what = "data.eval_holdout", f"the hold-out of {self.train_path}"
        else:
          evaluation = reader(self.eval_path, spec, num_epochs=1, **kw)
          eval_key, eval_what = "data.eval_path", self.eval_path
      except ValueError as e:  # a binary directory written for other tables
        raise base.ConfigError(f"config.data.train_path / eval_path: {e}") from None
      # Checked in this process: the workers start once, at the first training batch.
      _first_batch_or_fail(train, "data.train_path", self.train_path, batch_size)
      _first_batch_or_fail(evaluation, eval_key, eval_what, batch_size)
      if self.workers:
        train = reader(self.train_path, spec, workers=self.workers, **train_kw)
      return train, evaluation
    kw = dict(batch_size=batch_size, seed=seed, zipf_exponent=self.zipf_exponent,
              signal_scale=self.signal_scale, **share)
    train = data_lib.SyntheticSource(spec, split="train", **kw)
    evaluation = data_lib.SyntheticSource(spec, split="eval", num_batches=eval_batches, **kw)
    return train, evaluation

  def oracle(self, eval_source) -> dict:
    if not isinstance(eval_source, data_lib.SyntheticSource):
      return {}
    return {"oracle_auc": eval_source.oracle_metrics()["auc"]}

  def featurize(self, batch: dict) -> dict:
    """With raw ids, each feature's ids as exact uint32 words (``dynamic.words``)."""
    if not self.raw_ids:
      return batch
    return {**batch, "sparse": {k: dynamic.words(v) for k, v in batch["sparse"].items()}}

  def build_model(self, model_config, spec, mesh, *, batch_size: int, rngs):
    return factory.build_model(model_config, spec, mesh=mesh, batch_size=batch_size,
                               dynamic=self.raw_ids, rngs=rngs)

  def loss(self, model, batch):
    return steps.loss_fn(model, batch)

  def predict(self, model, batch):
    return model(batch["dense"], batch["sparse"])

  def evaluate(self, model, batches, mesh, source) -> dict:
    """AUC and log-loss over the eval batches (every process's rows)."""
    del mesh, source
    acc = metrics.StreamingMetrics()
    for batch in batches:
      logits = steps.eval_step(model, batch, task=self)
      acc.update(multihost_utils.process_allgather(batch["label"], tiled=True),
                 logits=multihost_utils.process_allgather(logits, tiled=True))
    if not acc.count:  # a NaN AUC must never pass as a result
      raise base.ConfigError("the eval data yielded no batch; check config.data.eval_path "
                             "(or eval_holdout) and config.eval_batches.")
    result = acc.result()
    return {"auc": result["auc"], "logloss": result["logloss"]}

