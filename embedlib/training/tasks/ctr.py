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
from embedlib import metrics
from embedlib.models import build_model
from embedlib.training import steps
from embedlib.training.tasks import base

SOURCES = ("synthetic", "criteo")


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


@dataclasses.dataclass(frozen=True)
class CTRTask(base.Task):
  """Binary click-through prediction: ``config.task.name = "ctr"``."""

  name = "ctr"

  def validate(self, config) -> None:
    data = config.data
    if data.source not in SOURCES:
      base.fail("data.source", f"{data.source!r}; the ctr task reads one of {SOURCES}.")
    if data.max_bad_lines < -1:
      base.fail("data.max_bad_lines", "must be >= 0, or -1 to skip every malformed line; "
                f"got {data.max_bad_lines}.")
    if not 0.0 <= data.eval_holdout < 1.0:
      base.fail("data.eval_holdout", f"must be a fraction in [0, 1); got {data.eval_holdout}.")
    if data.source == "criteo":
      if bool(data.eval_path) == bool(data.eval_holdout):
        base.fail("data.eval_path", "the criteo source evaluates on a file of its own "
                  "(data.eval_path) or on a held-out fraction of the training lines "
                  "(data.eval_holdout, e.g. 0.05): set exactly one, "
                  f"got eval_path={data.eval_path!r} and eval_holdout={data.eval_holdout}.")
      for key in ("train_path", "eval_path"):
        path = data[key]
        if key == "train_path" and not path:
          base.fail(f"data.{key}", "the criteo source needs a path to a Criteo TSV file.")
        if path and os.path.isdir(path):
          base.fail(f"data.{key}", f"{path!r} is a directory; pass the path of a .tsv or "
                    ".tsv.gz file in it.")
        if path and not os.path.isfile(path):
          base.fail(f"data.{key}", f"{path!r} does not exist; pass an existing .tsv or "
                    ".tsv.gz file in the Criteo layout.")
    elif data.eval_holdout:
      base.fail("data.eval_holdout", f"the {data.source} source has its own eval stream; "
                "leave eval_holdout at 0.")

  def data_spec(self, config) -> data_lib.DataSpec:
    try:
      if config.data.source == "criteo":
        return data_lib.criteo_spec(list(config.data.table_sizes) or 100_000)
      return data_lib.DataSpec.from_sizes(
          config.data.num_dense, list(config.data.table_sizes),
          bag_sizes=list(config.data.bag_sizes) or None)
    except ValueError as e:
      raise base.ConfigError(f"config.data.table_sizes / bag_sizes: {e}") from None

  def describe_eval(self, config) -> str:
    data = config.data
    if data.source != "criteo":
      return (f"the {data.source} source's eval stream ({config.eval_batches} batches, drawn "
              "apart from the training stream)")
    if data.eval_holdout:
      return (f"a held-out {data.eval_holdout:.1%} of the lines of {data.train_path} (chosen "
              f"by a hash of the line number; training skips them), at most "
              f"{config.eval_batches} batches")
    return f"{data.eval_path}, at most {config.eval_batches} batches"

  def sources(self, config, spec):
    share = dict(process_index=jax.process_index(), process_count=jax.process_count())
    data = config.data
    if data.source == "criteo":
      kw = dict(batch_size=config.batch_size, **share,
                max_bad_lines=None if data.max_bad_lines == -1 else data.max_bad_lines)
      train = data_lib.CriteoReader(data.train_path, spec, num_epochs=None,
                                    holdout=data.eval_holdout, split="train", **kw)
      if data.eval_holdout:
        evaluation = data_lib.CriteoReader(data.train_path, spec, num_epochs=1,
                                           holdout=data.eval_holdout, split="holdout", **kw)
        eval_key, eval_what = "data.eval_holdout", f"the hold-out of {data.train_path}"
      else:
        evaluation = data_lib.CriteoReader(data.eval_path, spec, num_epochs=1, **kw)
        eval_key, eval_what = "data.eval_path", data.eval_path
      _first_batch_or_fail(train, "data.train_path", data.train_path, config.batch_size)
      _first_batch_or_fail(evaluation, eval_key, eval_what, config.batch_size)
      return train, evaluation
    kw = dict(batch_size=config.batch_size, seed=config.seed,
              zipf_exponent=data.zipf_exponent, signal_scale=data.signal_scale, **share)
    train = data_lib.SyntheticSource(spec, split="train", **kw)
    evaluation = data_lib.SyntheticSource(spec, split="eval", num_batches=config.eval_batches,
                                          **kw)
    return train, evaluation

  def build_model(self, config, spec, mesh, rngs):
    return build_model(config.model, spec, mesh=mesh, batch_size=config.batch_size, rngs=rngs)

  def oracle(self, eval_source) -> dict:
    if not isinstance(eval_source, data_lib.SyntheticSource):
      return {}
    return {"oracle_auc": eval_source.oracle_metrics()["auc"]}

  def loss(self, model, batch):
    return steps.loss_fn(model, batch)

  def predict(self, model, batch):
    return model(batch["dense"], batch["sparse"])

  def evaluate(self, model, batches, mesh, source) -> dict:
    """AUC and log-loss over the eval batches (every process's rows)."""
    del mesh, source
    acc = metrics.StreamingMetrics()
    for batch in batches:
      logits = steps.eval_step(model, batch)
      acc.update(multihost_utils.process_allgather(batch["label"], tiled=True),
                 logits=multihost_utils.process_allgather(logits, tiled=True))
    if not acc.count:  # a NaN AUC must never pass as a result
      raise base.ConfigError("the eval data yielded no batch; check config.data.eval_path "
                             "(or eval_holdout) and config.eval_batches.")
    result = acc.result()
    return {"auc": result["auc"], "logloss": result["logloss"]}

