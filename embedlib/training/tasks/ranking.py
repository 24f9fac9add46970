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
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax

from embedlib import data as data_lib
from embedlib import metrics
from embedlib.data.multi_hash import MultiHash
from embedlib.models import build_model
from embedlib.training import steps
from embedlib.training.tasks import base, requests


@dataclasses.dataclass(frozen=True)
class RankingTask(base.Task):
  """Multi-action ranking: ``config.task.name = "ranking"``.

  Attributes:
    spec: the request layout.
    user_hasher: hashes raw user ids into the model's user table.
    loss_weights: per action, in the loss.
    ndcg_weights: per action, the gain NDCG ranks by.
    ndcg_k: the NDCG cut-off.
  """

  name = "ranking"
  spec: data_lib.SequenceSpec = None
  user_hasher: MultiHash = None
  loss_weights: tuple[float, ...] = ()
  ndcg_weights: tuple[float, ...] = ()
  ndcg_k: int = 10

  @classmethod
  def from_config(cls, config) -> RankingTask:
    spec = requests.spec(config, config.data.num_candidates)
    n = spec.num_actions
    if config.task.ndcg_k < 1:
      base.fail("task.ndcg_k", f"must be >= 1, got {config.task.ndcg_k}.")
    return cls(
        spec=spec, user_hasher=requests.hashers(config)["user"]
        if config.model.name == "ranker" else None,
        loss_weights=base.check_weights("task.loss_weights", config.task.loss_weights, n,
                                        "actions"),
        ndcg_weights=base.check_weights("task.ndcg_weights", config.task.ndcg_weights, n,
                                        "actions"),
        ndcg_k=int(config.task.ndcg_k))

  def validate(self, config) -> None:
    requests.check_model(config, ("ranker",), self.name)
    requests.check_source(config, "planted_ranking", self.name)
    base.check_positive(config, "data.num_candidates")

  def data_spec(self, config):
    return self.spec

  def sources(self, config, spec):
    return requests.sources(config, spec)

  def describe_eval(self, config) -> str:
    return requests.describe_eval(config, f", per-action AUC and NDCG@{self.ndcg_k}")

  def featurize(self, batch: dict) -> dict:
    self.spec.check_batch(batch, data_lib.sequences.RANKING)
    return dict(batch, user=self.user_hasher(batch["user"]))

  def build_model(self, config, spec, mesh, rngs):
    return build_model(config.model, spec, mesh=mesh, batch_size=config.batch_size, rngs=rngs)

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

  def oracle(self, eval_source) -> dict:
    acc = self._metrics()
    for batch, logits in eval_source.with_truth():
      acc.update(batch["labels"], logits, batch["candidate_item"] >= 0)
    return {f"oracle_{k}": v for k, v in acc.result().items()}
