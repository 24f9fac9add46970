"""What the ranking, retrieval and sequential tasks share: their data settings, hashing ids.

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
    raw_ids       the file's user and movie ids as they are, into the dynamic
                  tables of config.model.dynamic (user, item)
    prefetch

``RequestData.from_config`` reads these (but ``num_candidates`` and
``eval_candidates``, the ranking task's, and ``prefetch``, the loop's) once
per run, a MovieLens file's split included.
"""

from __future__ import annotations

import dataclasses
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


def check_model(model_name: str, names: tuple[str, ...], task: str) -> None:
  if model_name not in names:
    base.fail("model.name", f"{model_name!r} can't train the {task} task; use one of "
              f"{names}.")


def load_split(path_setting):
  """The leave-one-out split of ``config.data.path`` (``path_setting``), read from disk.

  Raises:
    ConfigError: the path is missing or holds no readable MovieLens data.
  """
  path = os.path.abspath(os.path.expanduser(path_setting or ""))
  if not path_setting or not os.path.exists(path):
    base.fail("data.path", f"{path_setting!r} does not exist; pass the MovieLens folder or "
              "ratings file: configs/movielens.py:/path/to/ml-100k.")
  from embedlib.data import movielens  # pylint: disable=g-import-not-at-top
  try:
    return movielens.leave_one_out(movielens.load(path))
  except (OSError, ValueError) as e:
    raise base.ConfigError(f"config.data.path={path_setting!r}: {e}") from None


@dataclasses.dataclass(frozen=True)
class RequestData:
  """A request task's ``config.data``: a planted world's sizes, or a MovieLens file's split.

  Host settings only: the tasks keep it out of their equality (the jitted
  steps' cache key), which their traced methods never read.
  """

  source: str
  history_len: int
  actions: tuple[str, ...]
  num_users: int = 0
  num_items: int = 0
  num_authors: int = 0
  num_topics: int = 0
  zipf_exponent: float = 1.0
  path: str = ""
  like_rating: float = 0.0
  raw_ids: bool = False
  split: object = dataclasses.field(default=None, repr=False, compare=False)

  @classmethod
  def from_config(cls, config, planted: str, task: str) -> RequestData:
    """``config.data`` of a task reading the planted source ``planted`` or MovieLens.

    Raises:
      ConfigError: naming the key and the fix.
    """
    data = config.data
    raw_ids = bool(data.get("raw_ids", False))
    if raw_ids and data.source != MOVIELENS:
      base.fail("data.raw_ids", f"the {data.source} source's ids are rows already; raw ids "
                f"read a MovieLens file (config.data.source={MOVIELENS!r}). Set "
                "config.data.raw_ids=False.")
    if data.source == MOVIELENS:
      base.check_positive(config, "data.history_len")
      if tuple(data.actions) != movielens_requests.ACTIONS:
        base.fail("data.actions", f"{tuple(data.actions)}: MovieLens requests' actions are "
                  f"{movielens_requests.ACTIONS}.")
      return cls(source=MOVIELENS, history_len=int(data.history_len),
                 actions=tuple(data.actions), path=data.path,
                 like_rating=data.like_rating, raw_ids=raw_ids,
                 split=load_split(data.path))
    if data.source != planted:
      base.fail("data.source", f"{data.source!r}: the {task} task reads {planted!r} or "
                f"{MOVIELENS!r}.")
    base.check_positive(config, "data.num_users", "data.num_topics", "data.history_len")
    return cls(source=data.source, history_len=int(data.history_len),
               actions=tuple(data.actions), num_users=data.num_users,
               num_items=data.num_items, num_authors=data.num_authors,
               num_topics=data.num_topics, zipf_exponent=data.zipf_exponent)

  @property
  def movielens(self) -> bool:
    return self.source == MOVIELENS

  def spec(self, num_candidates: int = 0) -> data_lib.SequenceSpec:
    """The request layout: the planted world's sizes, or the MovieLens file's."""
    if self.movielens:
      num_items, num_authors = self.split.num_items, 1  # MovieLens has no authors
      if self.raw_ids:  # the ids a request may hold: any raw id
        num_items = movielens_requests.RAW_ID_LIMIT
    else:
      num_items, num_authors = self.num_items, self.num_authors
    try:
      return data_lib.SequenceSpec(num_items=num_items, num_authors=num_authors,
                                   history_len=self.history_len, num_candidates=num_candidates,
                                   actions=self.actions)
    except ValueError as e:
      raise base.ConfigError(str(e)) from None

  def movielens_sources(self, cls, extra, *, batch_size: int, seed: int):
    """(train, valid) MovieLens request sources; the test source travels on the valid one."""
    made = {}
    for kind in movielens_requests.KINDS:
      try:
        made[kind] = cls(self.split, history_len=self.history_len, batch_size=batch_size,
                         seed=seed, kind=kind, like_rating=self.like_rating,
                         raw_ids=self.raw_ids,
                         process_index=jax.process_index(),
                         process_count=jax.process_count(), **extra(kind))
      except ValueError as e:
        raise base.ConfigError(f"config.data (MovieLens requests): {e}") from None
    made["valid"].test_source = made["test"]
    return made["train"], made["valid"]

  def planted_sources(self, spec, *, batch_size: int, seed: int, eval_batches: int):
    """(train, eval) planted sources of ``source``, this process's slice."""
    kw = dict(batch_size=batch_size, num_users=self.num_users, num_topics=self.num_topics,
              seed=seed, zipf_exponent=self.zipf_exponent,
              process_index=jax.process_index(), process_count=jax.process_count())
    try:
      cls = _SOURCES[self.source]
      return (cls(spec, split="train", **kw),
              cls(spec, split="eval", num_batches=eval_batches, **kw))
    except ValueError as e:
      raise base.ConfigError(str(e)) from None

  def describe_eval(self, what: str, *, batch_size: int, eval_batches: int) -> str:
    """Which examples the eval uses, for the log."""
    if self.movielens:
      rows = min(self.split.num_users, eval_batches * batch_size)
      return (f"the validation rating of {rows} of {self.split.num_users} users (each after "
              f"the user's training ratings){what}; the test rating at the end")
    return (f"the {self.source} source's eval stream ({eval_batches} batches of "
            f"{batch_size} requests, drawn apart from the training stream){what}")


def hashers(model_config, dynamic: tuple[str, ...] = ()) -> dict[str, MultiHash]:
  """The model's ``MultiHash`` per hashed table, but the ``dynamic`` ones (raw ids)."""
  try:
    found = factory.hashers(model_config)
  except ValueError as e:
    raise base.ConfigError(str(e)) from None
  return {k: v for k, v in found.items() if k not in dynamic}


def dynamic_tables(config, data: RequestData) -> tuple[str, ...]:
  """The tables read by raw ids (``config.model.dynamic``), or () without raw ids.

  Raises:
    ConfigError: a ``config.model.dynamic`` key the model can't use.
  """
  if not data.raw_ids:
    return ()
  try:
    return tuple(sorted(factory.request_dynamic(config.model)))
  except ValueError as e:
    raise base.ConfigError(str(e)) from None


def ids_or_hashed(batch: dict, key: str, hasher) -> np.ndarray:
  """``batch[key]`` hashed into the model's rows, or as int32 raw ids (a dynamic table)."""
  if hasher is not None:
    return hasher(batch[key])
  return np.asarray(batch[key]).astype(np.int32)  # range-checked by the source


def gather(x) -> np.ndarray:
  """Every process's rows of a global array, on the host."""
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
