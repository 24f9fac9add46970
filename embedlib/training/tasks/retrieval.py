"""``retrieval``: one engaged item per request, two towers, in-batch negatives.

Batches are request batches (``embedlib.data.sequences``) with the engaged
``item`` and its ``author``; on the host, user ids and item ids (the
engaged one and the history's) are hashed into the model's tables, and
the item ids travel along (``item_id``) to tell items apart in the loss.

Loss: softmax over the global batch's items (``in_batch_softmax_loss``),
with the log-Q correction ``config.task.log_q``: ``"batch"`` (each item's
count in the batch), ``"streaming"`` (``StreamingFrequency``, whose state
lives in the model as ``model.frequency`` and is checkpointed), or
``"none"``; and ``config.task.remove_accidental_hits``.

Eval: recall@K (``config.task.recall_ks``) of each eval request's engaged
item among the whole catalogue (``num_items`` items): the candidate tower
embeds the catalogue in chunks, split over every device of the mesh, and
``sharded_top_k`` finds each request's best items exactly (per-shard top-k,
then merged). Beside it, the recall of ranking by the planted
``P(item | history)`` (``oracle_recall@K``).

On MovieLens (``config.data.source = "movielens"``,
``embedlib.data.movielens_requests``) a request is a user's history and
the movie rated next; the eval is the sequential task's: each user's
held-out movie ranked among every movie through the item tower
(``metrics.full_ranking``, no sampled negatives), HR / NDCG / MRR @K for
``config.task.ks``, the validation movie at each eval and the test movie
(``test_*``) at the end; ``config.task.mask_seen`` leaves the user's
earlier movies out of the ranking.

With ``config.data.raw_ids`` (MovieLens) the requests carry the file's own
user and movie ids and the item table is a dynamic one
(``config.model.dynamic.item``; the user's too if named there, else the raw
user ids are hashed). The loss is unchanged (its ``item_id`` are the raw
ids). The eval ranks the item table's resident movies, by their raw ids
(the map's keys, ``DynamicEmbed.resident``): a held-out movie that is not
resident reads the default row and can't be retrieved, so it counts as a
miss, and ``mask_seen`` leaves out the seen movies that are resident.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import data as data_lib
from embedlib import metrics
from embedlib.data import movielens_requests
from embedlib.data.multi_hash import MultiHash
from embedlib.metrics import full_ranking
from embedlib.models import factory
from embedlib.models import retrieval as retrieval_lib
from embedlib.training.tasks import base, requests

LOG_Q = ("none", "batch", "streaming")


# Without graph updates: nnx.jit would return (copy) every table of the model.
@nnx.jit(graph_updates=False)
def _users(model, batch):
  return model.users(batch)


@nnx.jit(graph_updates=False)
def _candidates(model, rows, authors):
  return model.candidates(rows, authors)


_top_k = jax.jit(retrieval_lib.sharded_top_k, static_argnames=("k", "mesh", "axes", "num_valid"))


@functools.partial(jax.jit, static_argnames=("num_items",))
def _full_ranks(users, corpus, targets, exclude, num_items):
  """0-based rank of item ``targets`` among items ``0 .. num_items - 1`` by ``users @ corpus``."""
  scores = (users @ corpus.T)[:, :num_items]
  # full_ranking's column 0 is padding (never ranked): items move up by one.
  scores = jax.numpy.pad(scores, ((0, 0), (1, 0)))
  return full_ranking.target_ranks(scores, targets + 1, exclude=exclude)


#: Pads the sorted resident ids of a dynamic item table (no raw id is this large).
_NO_ITEM = movielens_requests.RAW_ID_LIMIT


@jax.jit
def _resident_ranks(users, corpus, keys, targets, exclude):
  """0-based rank of raw ids ``targets`` among the resident items ``keys`` (sorted, padded
  with ``_NO_ITEM``) by ``users @ corpus``; a target that is not resident ranks last.

  ``exclude``: raw ids not to rank, -1 padded, or None.
  """
  scores = jax.numpy.where(keys[None, :] < _NO_ITEM, users @ corpus.T, -jax.numpy.inf)

  def column(ids):  # 1 + the resident index of each raw id, 0 where not resident
    at = jax.numpy.clip(jax.numpy.searchsorted(keys, ids), 0, keys.shape[0] - 1)
    return jax.numpy.where((keys[at] == ids) & (ids >= 0), at + 1, 0)

  scores = jax.numpy.pad(scores, ((0, 0), (1, 0)))  # full_ranking's column 0 is padding
  found = column(targets)
  ranks = full_ranking.target_ranks(scores, jax.numpy.maximum(found, 1),
                                    exclude=None if exclude is None else column(exclude))
  return jax.numpy.where(found > 0, ranks, jax.numpy.iinfo(jax.numpy.int32).max)


@dataclasses.dataclass(frozen=True)
class RetrievalTask(base.Task):
  """Two-tower retrieval: ``config.task.name = "retrieval"``.

  Attributes:
    spec: the request layout.
    user_hasher, item_hasher: hash raw ids into the model's tables.
    log_q: ``"none" | "batch" | "streaming"``.
    remove_accidental_hits: mask other requests' copies of a request's item.
    recall_ks: the recall cut-offs.
    frequency_buckets, frequency_alpha: the streaming estimate's size and rate.
    corpus_chunk: catalogue items embedded per call in an eval.
    movielens: requests from a MovieLens file; the eval ranks every movie.
    ks: MovieLens: the full-ranking metrics' cut-offs.
    mask_seen: MovieLens: leave each user's earlier movies out of the ranking.
    dynamic: the tables read by raw ids (``config.data.raw_ids``).
    data: ``config.data`` (host only: out of the task's equality).
  """

  name = "retrieval"
  spec: data_lib.SequenceSpec = None
  user_hasher: MultiHash = None
  item_hasher: MultiHash = None
  log_q: str = "batch"
  remove_accidental_hits: bool = True
  recall_ks: tuple[int, ...] = (1, 10, 100)
  frequency_buckets: int = 1 << 16
  frequency_alpha: float = 0.01
  corpus_chunk: int = 1 << 16
  movielens: bool = False
  ks: tuple[int, ...] = (10, 20)
  mask_seen: bool = False
  dynamic: tuple[str, ...] = ()
  data: requests.RequestData = dataclasses.field(default=None, compare=False)

  @classmethod
  def from_config(cls, config) -> RetrievalTask:
    requests.check_model(config.model.name, ("two_tower",), cls.name)
    data = requests.RequestData.from_config(config, "planted_retrieval", cls.name)
    task = config.task
    if task.log_q not in LOG_Q:
      base.fail("task.log_q", f"{task.log_q!r}; use one of {LOG_Q}.")
    spec = data.spec()
    if data.movielens:
      ks = tuple(sorted(int(k) for k in task.ks))
      if not ks or ks[0] < 1:
        base.fail("task.ks", f"{tuple(task.ks)}: give cut-offs >= 1, e.g. (10, 20).")
      extra = dict(ks=ks, mask_seen=bool(task.mask_seen))
    else:
      ks = tuple(sorted(int(k) for k in task.recall_ks))
      if not ks or ks[0] < 1 or ks[-1] > spec.num_items:
        base.fail("task.recall_ks", f"{tuple(task.recall_ks)}: each K must lie in [1, "
                  f"num_items={spec.num_items}].")
      extra = dict(recall_ks=ks)
    if task.corpus_chunk < 1:
      base.fail("task.corpus_chunk", f"must be >= 1, got {task.corpus_chunk}.")
    dynamic = requests.dynamic_tables(config, data)
    found = requests.hashers(config.model, dynamic)
    return cls(spec=spec, user_hasher=found.get("user"), dynamic=dynamic,
               item_hasher=found.get("item"), log_q=task.log_q,
               remove_accidental_hits=bool(task.remove_accidental_hits),
               frequency_buckets=int(task.frequency_buckets),
               frequency_alpha=float(task.frequency_alpha), corpus_chunk=int(task.corpus_chunk),
               movielens=data.movielens, data=data, **extra)

  def data_spec(self):
    return self.spec

  def sources(self, spec, *, batch_size: int, seed: int, eval_batches: int):
    if self.movielens:
      return self.data.movielens_sources(
          movielens_requests.RetrievalRequests, lambda kind: dict(exclude_seen=self.mask_seen),
          batch_size=batch_size, seed=seed)
    return self.data.planted_sources(spec, batch_size=batch_size, seed=seed,
                                     eval_batches=eval_batches)

  def describe_eval(self, *, batch_size: int, eval_batches: int) -> str:
    if self.movielens:
      seen = "without" if self.mask_seen else "with"
      among = ("the item table's resident movies (by raw id; one not resident is a miss)"
               if self.dynamic else f"all {self.spec.num_items} movies")
      what = (f" ranked among {among} ({seen} the user's "
              f"earlier ones) through the item tower, HR/NDCG/MRR@{list(self.ks)}")
    else:
      what = f", recall@{list(self.recall_ks)} over all {self.spec.num_items} items"
    return self.data.describe_eval(what, batch_size=batch_size, eval_batches=eval_batches)

  def featurize(self, batch: dict) -> dict:
    self.spec.check_batch(batch, data_lib.sequences.RETRIEVAL)
    out = {
        "user": requests.ids_or_hashed(batch, "user", self.user_hasher),
        "history_item": requests.ids_or_hashed(batch, "history_item", self.item_hasher),
        "history_author": batch["history_author"],
        "history_actions": batch["history_actions"],
        "item": requests.ids_or_hashed(batch, "item", self.item_hasher),
        "item_id": batch["item"],
        "author": batch["author"],
    }
    # MovieLens eval rows: padding rows weigh 0; the movies not to rank.
    out.update({k: batch[k] for k in ("weight", "exclude") if k in batch})
    return out

  def build_model(self, model_config, spec, mesh, *, batch_size: int, rngs):
    try:
      model = factory.build_model(model_config, spec, mesh=mesh, batch_size=batch_size,
                                  dynamic=bool(self.dynamic), rngs=rngs)
    except ValueError as e:
      raise base.ConfigError(str(e)) from None
    if self.log_q == "streaming":
      try:
        model.frequency = retrieval_lib.StreamingFrequency(self.frequency_buckets,
                                                           alpha=self.frequency_alpha)
      except ValueError as e:
        raise base.ConfigError(str(e)) from None
    return model

  def loss(self, model, batch):
    users, items = model.users_and_candidates(batch)
    ids = batch["item_id"]
    log_q = {"none": lambda: None, "batch": lambda: retrieval_lib.batch_log_q(ids),
             "streaming": lambda: model.frequency.update(ids)}[self.log_q]()
    return retrieval_lib.in_batch_softmax_loss(
        users, items, ids, temperature=model.temperature(), log_q=log_q,
        remove_accidental_hits=self.remove_accidental_hits, mesh=model.mesh)

  def predict(self, model, batch):
    return model.users(batch)

  def log_scalars(self, model) -> dict:
    return {"temperature": float(model.temperature())}

  def corpus(self, model, mesh, item_authors: np.ndarray, raw=None) -> jax.Array:
    """Unit embeddings of every item ``[N_padded, features]``, rows split over all of ``mesh``.

    Args:
      model: the ``TwoTower``.
      mesh: the mesh.
      item_authors: int ``[num_items]``, each item's author (the source's
        ``catalogue()``), or with ``raw`` ``[len(raw)]``.
      raw: a dynamic item table's resident raw ids ``[n]`` padded with
        ``_NO_ITEM`` to its capacity, embedded by raw id (None: items
        ``0 .. num_items - 1``, hashed).
    """
    n, shards = self.spec.num_items if raw is None else len(raw), mesh.size
    chunk = -(-min(self.corpus_chunk, n) // shards) * shards
    padded = -(-n // chunk) * chunk
    ids = np.arange(padded)
    if raw is None:
      rows = np.where((ids < n)[:, None], self.item_hasher(np.minimum(ids, n - 1)), 0)
    else:  # padding reads zeros (-1 is never admitted)
      real = np.pad(raw, (0, padded - n), constant_values=_NO_ITEM)
      rows = np.where(real < _NO_ITEM, real, -1).astype(np.int32)
    authors = np.where(ids < n, item_authors[np.minimum(ids, n - 1)], -1).astype(np.int32)
    split = NamedSharding(mesh, P(mesh.axis_names))
    place = lambda x: jax.make_array_from_callback(x.shape, split, lambda i: x[i])
    parts = [jax.block_until_ready(
        _candidates(model, place(rows[s:s + chunk]), place(authors[s:s + chunk])))
             for s in range(0, padded, chunk)]
    return jax.numpy.concatenate(parts) if len(parts) > 1 else parts[0]

  def resident_items(self, model) -> np.ndarray:
    """A dynamic item table's resident raw ids, sorted, padded to its capacity with
    ``_NO_ITEM`` (int32 ``[capacity]``): the candidates its eval ranks."""
    table = model.items
    # The map's rows are split over the devices, of every process: gather them all.
    hi, lo, score = (requests.gather(v[...]) for v in (table.keys_hi, table.keys_lo,
                                                        table.score))
    here = score >= 0
    keys = np.sort((hi[here].astype(np.int64) << 32) | lo[here].astype(np.int64))
    return np.pad(keys, (0, table.policy.capacity - len(keys)),
                  constant_values=_NO_ITEM).astype(np.int32)

  def resident_corpus(self, model, mesh) -> tuple[jax.Array, np.ndarray]:
    """A dynamic item table's corpus: ``(corpus, keys)``, its resident movies embedded
    (``corpus``) and their raw ids, padded with ``_NO_ITEM`` to the corpus's rows."""
    keys = self.resident_items(model)
    corpus = self.corpus(model, mesh, np.zeros(len(keys), np.int32), raw=keys)
    # As long as the corpus, whose chunks round it up.
    return corpus, np.pad(keys, (0, corpus.shape[0] - len(keys)), constant_values=_NO_ITEM)

  def _rank(self, model, batches, mesh, source) -> dict:
    """Full-ranking metrics of the MovieLens held-out movies among every movie (or, raw
    ids, every resident one)."""
    if self.dynamic:
      corpus, keys = self.resident_corpus(model, mesh)
    else:
      corpus, keys = self.corpus(model, mesh, source.catalogue()), None
    acc = full_ranking.FullRankingMetrics(self.ks)
    for batch in batches:
      users = jax.block_until_ready(_users(model, batch))  # one program in flight: train_lib
      if keys is not None:
        ranks = _resident_ranks(users, corpus, jax.numpy.asarray(keys), batch["item_id"],
                                batch.get("exclude"))
      else:
        ranks = _full_ranks(users, corpus, batch["item_id"], batch.get("exclude"),
                            num_items=self.spec.num_items)
      acc.update(requests.gather(ranks), requests.gather(batch["weight"]))
    result = acc.result()
    if not result.pop("count"):
      raise base.ConfigError("the eval data yielded no row; check config.eval_batches.")
    return result

  def test(self, model, eval_source, mesh) -> dict:
    if not self.movielens:
      return {}
    source = eval_source.test_source
    source.set_state({"position": 0})
    batches = (data_lib.to_global_batch(self.featurize(b), mesh) for b in source)
    return {f"test_{k}": v for k, v in self._rank(model, batches, mesh, source).items()}

  def evaluate(self, model, batches, mesh, source) -> dict:
    if self.movielens:
      return self._rank(model, batches, mesh, source)
    corpus = self.corpus(model, mesh, source.catalogue())
    acc = metrics.RetrievalMetrics(self.recall_ks)
    for batch in batches:
      users = jax.block_until_ready(_users(model, batch))  # one program in flight: train_lib
      _, top = _top_k(users, corpus, k=self.recall_ks[-1], mesh=mesh,
                      axes=tuple(mesh.axis_names), num_valid=self.spec.num_items)
      acc.update(np.asarray(top.addressable_data(0)), requests.gather(batch["item_id"]))
    if not acc.count:
      raise base.ConfigError("the eval data yielded no batch; check config.eval_batches.")
    return acc.result()

  def oracle(self, eval_source) -> dict:
    if self.movielens:  # no planted truth
      return {}
    acc = metrics.RetrievalMetrics(self.recall_ks)
    for batch, probs in eval_source.with_truth():
      acc.update(eval_source.oracle_top_k(probs, self.recall_ks[-1]), batch["item"])
    return {f"oracle_{k}": v for k, v in acc.result().items()}
