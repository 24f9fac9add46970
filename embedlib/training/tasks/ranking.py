"""``ranking``: several actions per candidate of a request (the transformer ranker).

Batches are request batches (``embedlib.data.sequences``) with per-action
labels ``[B, C, A]``; the device sees user ids hashed into the model's user
table. The loss is a masked, per-action weighted sigmoid cross-entropy:

    loss = sum_a w_a * mean over real candidates of CE(logit_a, label_a) / sum_a w_a

with ``w = config.task.loss_weights``. An eval reports the AUC of each
action over all real candidates (``auc/<action>``), their mean, and
NDCG@K over each request's candidates, on gains ``sum_a g_a label_a``
ranked by ``sum_a g_a sigmoid(logit_a)`` (``g = config.task.ndcg_weights``,
``K = config.task.ndcg_k``); beside them, the same metrics of the planted
source's true logits (``oracle_*``).

On MovieLens (``config.data.source = "movielens"``,
``embedlib.data.movielens_requests``) ratings are the actions (``rated``,
``liked``: a rating of at least ``config.data.like_rating``): a training
request's candidates are the movie the user rated next and
``config.data.num_candidates - 1`` movies the user has not rated; an eval
request's are each user's held-out movie and
``config.data.eval_candidates - 1`` movies the user never rated (the SASRec
paper's sampled protocol at 101), the validation movie at each eval and the
test movie (``test_*``) at the end. With ``config.data.raw_ids`` the
requests carry the file's own user and movie ids, read by the dynamic
tables of ``config.model.dynamic`` (the item table, and the user's if named
there; a user table left out hashes the raw user ids).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax

from embedlib import data as data_lib
from embedlib import metrics
from embedlib.data import movielens_requests
from embedlib.data.multi_hash import MultiHash
from embedlib.models import factory
from embedlib.training import steps
from embedlib.training.tasks import base, requests


@dataclasses.dataclass(frozen=True)
class RankingTask(base.Task):
  """Multi-action ranking: ``config.task.name = "ranking"``.

  Attributes:
    spec: the request layout.
    eval_candidates: candidates per eval request where they differ from the
      training requests' (MovieLens), else 0.
    user_hasher: hashes user ids into the model's user table (None: the
      table is dynamic, read by raw ids).
    dynamic: the tables read by raw ids (``config.data.raw_ids``).
    loss_weights: per action, in the loss.
    ndcg_weights: per action, the gain NDCG ranks by.
    ndcg_k: the NDCG cut-off.
    data: ``config.data`` (host only: out of the task's equality).
  """

  name = "ranking"
  spec: data_lib.SequenceSpec = None
  eval_candidates: int = 0
  user_hasher: MultiHash = None
  loss_weights: tuple[float, ...] = ()
  ndcg_weights: tuple[float, ...] = ()
  ndcg_k: int = 10
  dynamic: tuple[str, ...] = ()
  data: requests.RequestData = dataclasses.field(default=None, compare=False)

  @classmethod
  def from_config(cls, config) -> RankingTask:
    model_name = config.model.name
    requests.check_model(model_name, ("ranker",), cls.name)
    data = requests.RequestData.from_config(config, "planted_ranking", cls.name)
    num_candidates = config.data.num_candidates
    if num_candidates < 1:
      base.fail("data.num_candidates", f"must be >= 1, got {num_candidates}.")
    spec = data.spec(num_candidates)
    n = spec.num_actions
    if config.task.ndcg_k < 1:
      base.fail("task.ndcg_k", f"must be >= 1, got {config.task.ndcg_k}.")
    eval_candidates = 0
    if data.movielens:
      eval_candidates = int(config.data.eval_candidates)
      for key, value in (("data.num_candidates", spec.num_candidates),
                         ("data.eval_candidates", eval_candidates)):
        if value < 2:
          base.fail(key, "give at least 2: the rated movie and one it is ranked against.")
    dynamic = requests.dynamic_tables(config, data)
    return cls(
        spec=spec, eval_candidates=eval_candidates, data=data, dynamic=dynamic,
        user_hasher=requests.hashers(config.model, dynamic).get("user"),
        loss_weights=base.check_weights("task.loss_weights", config.task.loss_weights, n,
                                        "actions"),
        ndcg_weights=base.check_weights("task.ndcg_weights", config.task.ndcg_weights, n,
                                        "actions"),
        ndcg_k=int(config.task.ndcg_k))

  def data_spec(self):
    return self.spec

  def sources(self, spec, *, batch_size: int, seed: int, eval_batches: int):
    if self.data.movielens:
      return self.data.movielens_sources(
          movielens_requests.RankingRequests,
          lambda kind: dict(num_candidates=self.spec.num_candidates if kind == "train"
                            else self.eval_candidates),
          batch_size=batch_size, seed=seed)
    return self.data.planted_sources(spec, batch_size=batch_size, seed=seed,
                                     eval_batches=eval_batches)

  def describe_eval(self, *, batch_size: int, eval_batches: int) -> str:
    if self.data.movielens:
      what = (f" among {self.eval_candidates - 1} movies the user never rated, "
              f"per-action AUC and NDCG@{self.ndcg_k}")
    else:
      what = f", per-action AUC and NDCG@{self.ndcg_k}"
    return self.data.describe_eval(what, batch_size=batch_size, eval_batches=eval_batches)

  def featurize(self, batch: dict) -> dict:
    spec = self.spec
    if self.eval_candidates and np.shape(batch["candidate_item"])[1] == self.eval_candidates:
      spec = dataclasses.replace(spec, num_candidates=self.eval_candidates)
    spec.check_batch(batch, data_lib.sequences.RANKING)
    return dict(batch, user=requests.ids_or_hashed(batch, "user", self.user_hasher))

  def build_model(self, model_config, spec, mesh, *, batch_size: int, rngs):
    return factory.build_model(model_config, spec, mesh=mesh, batch_size=batch_size,
                               dynamic=self.data.raw_ids, rngs=rngs)

  def loss(self, model, batch):
    logits = model(batch)  # [B, C, A]
    mask = (batch["candidate_item"] >= 0).astype(logits.dtype)[..., None]
    ce = optax.sigmoid_binary_cross_entropy(logits, batch["labels"]) * mask
    per_action = ce.sum(axis=(0, 1)) / jnp.maximum(mask.sum(), 1.0)
    weights = jnp.asarray(self.loss_weights, logits.dtype)
    return jnp.dot(weights, per_action) / weights.sum()

  def predict(self, model, batch):
    return model(batch)

  def _metrics(self) -> metrics.RankingMetrics:
    return metrics.RankingMetrics(self.spec.actions, ndcg_weights=self.ndcg_weights,
                                  k=self.ndcg_k)

  def evaluate(self, model, batches, mesh, source) -> dict:
    del mesh, source
    acc = self._metrics()
    for batch in batches:
      logits = steps.eval_step(model, batch, task=self)
      acc.update(requests.gather(batch["labels"]), requests.gather(logits),
                 requests.gather(batch["candidate_item"]) >= 0)
    if not acc.count:
      raise base.ConfigError("the eval data yielded no batch; check config.eval_batches.")
    return acc.result()

  def test(self, model, eval_source, mesh) -> dict:
    source = getattr(eval_source, "test_source", None)
    if source is None:  # planted data: no test set
      return {}
    source.set_state({"position": 0})
    batches = (data_lib.to_global_batch(self.featurize(b), mesh) for b in source)
    return {f"test_{k}": v for k, v in self.evaluate(model, batches, mesh, source).items()}

  def oracle(self, eval_source) -> dict:
    if not hasattr(eval_source, "with_truth"):  # MovieLens: no planted truth
      return {}
    acc = self._metrics()
    for batch, logits in eval_source.with_truth():
      acc.update(batch["labels"], logits, batch["candidate_item"] >= 0)
    return {f"oracle_{k}": v for k, v in acc.result().items()}
