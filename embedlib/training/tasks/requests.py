"""What the ranking and retrieval tasks share: request data from a config, hashing ids.

``config.data`` of a request task::

    source        "planted_ranking" | "planted_retrieval"
    num_users, num_items, num_authors, num_topics
    history_len   S, the most history events per request
    num_candidates C (ranking)
    actions       the action names, in label order
    zipf_exponent popularity skew of items within a topic
    prefetch      batches prepared ahead
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from embedlib import data as data_lib
from embedlib.data.multi_hash import MultiHash
from embedlib.models import factory
from embedlib.training.tasks import base

_SOURCES = {"planted_ranking": data_lib.PlantedRankingSource,
            "planted_retrieval": data_lib.PlantedRetrievalSource}


def check_model(config, names: tuple[str, ...], task: str) -> None:
  if config.model.name not in names:
    base.fail("model.name", f"{config.model.name!r} can't train the {task} task; use one of "
              f"{names}.")


def check_source(config, source: str, task: str) -> None:
  if config.data.source != source:
    base.fail("data.source", f"{config.data.source!r}: the {task} task reads {source!r}.")
  base.check_positive(config, "data.num_users", "data.num_topics", "data.history_len")


def spec(config, num_candidates: int = 0) -> data_lib.SequenceSpec:
  data = config.data
  try:
    return data_lib.SequenceSpec(num_items=data.num_items, num_authors=data.num_authors,
                                 history_len=data.history_len, num_candidates=num_candidates,
                                 actions=tuple(data.actions))
  except ValueError as e:
    raise base.ConfigError(str(e)) from None


def sources(config, spec_):
  """(train, eval) planted sources of ``config.data.source``, this process's slice."""
  data = config.data
  kw = dict(batch_size=config.batch_size, num_users=data.num_users,
            num_topics=data.num_topics, seed=config.seed, zipf_exponent=data.zipf_exponent,
            process_index=jax.process_index(), process_count=jax.process_count())
  try:
    cls = _SOURCES[data.source]
    return (cls(spec_, split="train", **kw),
            cls(spec_, split="eval", num_batches=config.eval_batches, **kw))
  except ValueError as e:
    raise base.ConfigError(str(e)) from None


def hashers(config) -> dict[str, MultiHash]:
  try:
    return factory.hashers(config.model)
  except ValueError as e:
    raise base.ConfigError(str(e)) from None


def describe_eval(config, what: str) -> str:
  return (f"the {config.data.source} source's eval stream ({config.eval_batches} batches of "
          f"{config.batch_size} requests, drawn apart from the training stream){what}")


def gather(x) -> np.ndarray:
  """Every process's rows of a global array, on the host."""
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
