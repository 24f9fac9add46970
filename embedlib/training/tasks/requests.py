"""What the ranking, retrieval and sequential tasks share: data from a config, hashing ids.

``config.data`` of a request task on planted data::

    source        "planted_ranking" | "planted_retrieval"
    num_users, num_items, num_authors, num_topics
    history_len   S, the most history events per request
    num_candidates C (ranking)
    actions       the action names, in label order
    zipf_exponent popularity skew of items within a topic
    prefetch      batches prepared ahead

and on MovieLens (``embedlib.data.movielens_requests``; the sizes come
from the file)::

    source        "movielens"
    path          the release's folder or ratings file
    history_len   S
    num_candidates C (ranking): the rated movie and C - 1 unrated ones in training
    eval_candidates (ranking) the same in the eval and test requests
    like_rating   the least rating that is a "liked" action
    actions       ("rated", "liked")
    prefetch
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from embedlib import data as data_lib
from embedlib.data import movielens_requests
from embedlib.data.multi_hash import MultiHash
from embedlib.models import factory
from embedlib.training.tasks import base

MOVIELENS = "movielens"

_SOURCES = {"planted_ranking": data_lib.PlantedRankingSource,
            "planted_retrieval": data_lib.PlantedRetrievalSource}


def check_model(config, names: tuple[str, ...], task: str) -> None:
  if config.model.name not in names:
    base.fail("model.name", f"{config.model.name!r} can't train the {task} task; use one of "
              f"{names}.")


@functools.lru_cache(maxsize=2)
def _split(path: str, stamp: tuple):
  """The leave-one-out split of ``path``; ``stamp`` (its mtime and size) renews the cache."""
  del stamp
  from embedlib.data import movielens  # pylint: disable=g-import-not-at-top
  return movielens.leave_one_out(movielens.load(path))


def load_split(config):
  """The split ``config.data.path`` holds, read once per run (the task asks several times).

  Raises:
    ConfigError: the path is missing or holds no readable MovieLens data.
  """
  path = os.path.abspath(os.path.expanduser(config.data.path or ""))
  if not config.data.path or not os.path.exists(path):
    base.fail("data.path", f"{config.data.path!r} does not exist; pass the MovieLens folder or "
              "ratings file: configs/movielens.py:/path/to/ml-100k.")
  info = os.stat(path)
  try:
    return _split(path, (info.st_mtime_ns, info.st_size))
  except (OSError, ValueError) as e:
    raise base.ConfigError(f"config.data.path={config.data.path!r}: {e}") from None


def is_movielens(config) -> bool:
  return config.data.source == MOVIELENS


def check_source(config, source: str, task: str) -> None:
  """``config.data.source`` is ``source`` (planted) or ``movielens``, with its sizes."""
  if is_movielens(config):
    base.check_positive(config, "data.history_len")
    load_split(config)
    return
  if config.data.source != source:
    base.fail("data.source", f"{config.data.source!r}: the {task} task reads {source!r} or "
              f"{MOVIELENS!r}.")
  base.check_positive(config, "data.num_users", "data.num_topics", "data.history_len")


def spec(config, num_candidates: int = 0) -> data_lib.SequenceSpec:
  """The request layout: the planted world's sizes, or the MovieLens file's."""
  data = config.data
  if is_movielens(config):
    if tuple(data.actions) != movielens_requests.ACTIONS:
      base.fail("data.actions", f"{tuple(data.actions)}: MovieLens requests' actions are "
                f"{movielens_requests.ACTIONS}.")
    num_items, num_authors = load_split(config).num_items, 1  # MovieLens has no authors
  else:
    num_items, num_authors = data.num_items, data.num_authors
  try:
    return data_lib.SequenceSpec(num_items=num_items, num_authors=num_authors,
                                 history_len=data.history_len, num_candidates=num_candidates,
                                 actions=tuple(data.actions))
  except ValueError as e:
    raise base.ConfigError(str(e)) from None


def _movielens_sources(config, cls, extra):
  """(train, valid) MovieLens request sources; the test source travels on the valid one."""
  made = {}
  for kind in movielens_requests.KINDS:
    try:
      made[kind] = cls(load_split(config), history_len=config.data.history_len,
                       batch_size=config.batch_size, seed=config.seed, kind=kind,
                       like_rating=config.data.like_rating,
                       process_index=jax.process_index(),
                       process_count=jax.process_count(), **extra(kind))
    except ValueError as e:
      raise base.ConfigError(f"config.data (MovieLens requests): {e}") from None
  made["valid"].test_source = made["test"]
  return made["train"], made["valid"]


def movielens_retrieval_sources(config, exclude_seen: bool):
  """(train, valid) ``RetrievalRequests``; the test source is the valid one's ``test_source``."""
  return _movielens_sources(config, movielens_requests.RetrievalRequests,
                            lambda kind: dict(exclude_seen=exclude_seen))


def movielens_ranking_sources(config):
  """(train, valid) ``RankingRequests``; the test source is the valid one's ``test_source``."""
  data = config.data
  return _movielens_sources(config, movielens_requests.RankingRequests, lambda kind: dict(
      num_candidates=data.num_candidates if kind == "train" else data.eval_candidates))


def describe_movielens(config, what: str) -> str:
  split = load_split(config)
  rows = min(split.num_users, config.eval_batches * config.batch_size)
  return (f"the validation rating of {rows} of {split.num_users} users (each after the "
          f"user's training ratings){what}; the test rating at the end")


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
