"""``sequential``: the next item of each user's history, over the whole item vocabulary.

Data: a MovieLens release or RecBole atomic files (``config.data.path``),
read by ``embedlib.data.movielens`` and split leave-one-out; batches from
``embedlib.data.next_item`` (training windows of up to ``max_len + 1``
items, every training item but a user's first a target once per epoch;
eval rows of the last ``max_len`` items before the held-out one).

Loss: softmax cross-entropy of every position's next item over the whole
vocabulary, the logits made by the tied item table
(``ShardedEmbed.attend``) and reduced by ``vocab_parallel_cross_entropy``:
where the table is split by rows, each device keeps its own rows' logits,
so an item vocabulary of any size shards. The item table trains with the
dense optimizer (``sparse_tables``: its gradient through ``attend`` is
dense). Dropout (``config.model.dropout``) draws its masks from the batch's
per-row seeds, so a resumed run trains exactly as an uninterrupted one.

Eval: the rank of each user's held-out item among all items
(``metrics.full_ranking``; no sampled negatives), HR@K, NDCG@K and MRR@K for
``config.task.ks``: the validation item at each eval, the test item once at
the end (``test_*``). ``config.task.mask_seen`` leaves the items a user has
already had out of the ranking; off by default, as RecBole evaluates
sequential models.

Raw ids (``config.data.raw_ids``): the batches hold the file's movie ids
(-1 padding), the item table is a ``DynamicEmbed`` of
``config.model.dynamic.item``, and the model turns each batch's ids into
its rows first (``to_rows``: inputs and targets in one step of the
table's policy). The logits are the table's rows, those holding no id
masked out; the eval ranks the held-out movie among the resident ones,
and one that is not resident is a miss (docs/guides/dynamic_tables.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from embedlib import data as data_lib
from embedlib import logits as logits_lib
from embedlib import options
from embedlib.data import next_item
from embedlib.losses import vocab_parallel_cross_entropy
from embedlib.metrics import full_ranking
from embedlib.models import factory
from embedlib.models.blocks import RowDropout, no_dropout
from embedlib.training import steps
from embedlib.training.tasks import base, requests

SOURCES = ("movielens",)


def _to_int32_offsets(batch: dict, pad: int) -> dict:
  """Times as int32 seconds since the row's earliest: only gaps matter, and they fit."""
  times, query = np.asarray(batch["times"]), np.asarray(batch["query_times"])
  real = np.asarray(batch["items"]) > pad
  big = np.iinfo(np.int64).max
  first = np.minimum(np.where(real, times, big).min(axis=1), np.where(real, query, big).min(axis=1))
  first = np.where(first == big, 0, first)[:, None]
  out = dict(batch)
  out["times"] = np.where(real, times - first, 0).astype(np.int32)
  out["query_times"] = np.where(real, query - first, 0).astype(np.int32)
  return out


def _item_columns(data, split, raw_ids: bool) -> dict | None:
  """The items' side columns ``config.data.item_columns`` names, read from the ``.item`` file."""
  names = tuple(n.strip() for n in (data.get("item_columns") or "").split(",") if n.strip())
  if not names:
    return None
  if raw_ids:
    base.fail("data.item_columns", "the side columns are read by dense item ids; leave "
              "config.data.raw_ids off with them.")
  from embedlib.data.movielens import formats  # pylint: disable=g-import-not-at-top
  from embedlib.tabular import item_side  # pylint: disable=g-import-not-at-top

  try:
    layout, _, items = formats.find(data.path)
  except (OSError, ValueError) as e:
    raise base.ConfigError(f"config.data.path: {e}") from None
  if layout.name != "recbole" or not items:
    base.fail("data.item_columns", f"{data.path} has no RecBole .item file; side columns are "
              "read from RecBole's atomic files (<dataset>.item beside the .inter file).")
  try:
    return item_side.read(items, names, split.raw_item_ids)
  except ValueError as e:
    raise base.ConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class SequentialTask(base.Task):
  """Next-item prediction: ``config.task.name = "sequential"``.

  Attributes:
    dropout: the models' dropout rate in training.
    mask_seen: leave each user's earlier items out of the ranking.
    ks: the metrics' cut-offs.
    raw_ids: the batches hold the file's movie ids (-1 padding), read by a
      dynamic item table (``config.data.raw_ids``).
    max_len, stride: the windows' settings (``config.data``; host only, as
      ``split``, the file's leave-one-out split, read once).
  """

  name = "sequential"
  sparse_tables = False
  dropout: float = 0.0
  mask_seen: bool = False
  ks: tuple[int, ...] = (10, 20)
  raw_ids: bool = False
  max_len: int = dataclasses.field(default=0, compare=False)
  stride: int | None = dataclasses.field(default=None, compare=False)
  split: object = dataclasses.field(default=None, repr=False, compare=False)
  item_columns: dict | None = dataclasses.field(default=None, repr=False, compare=False)

  @classmethod
  def from_config(cls, config) -> SequentialTask:
    requests.check_model(config.model.name, factory.NEXT_ITEM, cls.name)
    data = config.data
    raw_ids = bool(data.get("raw_ids", False))
    if raw_ids:
      try:
        factory.next_item_dynamic(config.model)
      except ValueError as e:
        raise base.ConfigError(str(e)) from None
    if data.source not in SOURCES:
      base.fail("data.source", f"{data.source!r}: the {cls.name} task reads one of "
                f"{SOURCES}.")
    split = requests.load_split(data.path)
    ks = tuple(sorted(int(k) for k in config.task.ks))
    if not ks or ks[0] < 1:
      base.fail("task.ks", f"{tuple(config.task.ks)}: give cut-offs >= 1, e.g. (10, 20).")
    dropout = float(config.model.dropout)
    if not 0.0 <= dropout < 1.0:
      base.fail("model.dropout", f"{dropout} must lie in [0, 1).")
    max_len = data.max_len
    if max_len < 1:
      base.fail("data.max_len", f"must be >= 1, got {max_len}.")
    stride = data.get("stride")
    if stride is not None and not 1 <= stride <= max_len:
      base.fail("data.stride", f"{stride} must lie in [1, data.max_len={max_len}] "
                "(None: max_len).")
    return cls(dropout=dropout, mask_seen=bool(config.task.mask_seen), ks=ks,
               max_len=int(max_len), stride=stride, split=split, raw_ids=raw_ids,
               item_columns=_item_columns(data, split, raw_ids))

  def data_spec(self):
    return next_item.NextItemSpec(num_items=int(self.split.num_items), max_len=self.max_len,
                                  item_columns=self.item_columns)

  def _source(self, kind: str, *, batch_size: int, seed: int) -> next_item.NextItemSource:
    return next_item.NextItemSource(
        self.split, max_len=self.max_len, batch_size=batch_size, seed=seed,
        stride=self.stride, kind=kind, exclude_seen=self.mask_seen, raw_ids=self.raw_ids,
        process_index=jax.process_index(), process_count=jax.process_count())

  def sources(self, spec, *, batch_size: int, seed: int, eval_batches: int):
    del spec, eval_batches
    made = {kind: self._source(kind, batch_size=batch_size, seed=seed)
            for kind in (next_item.TRAIN, next_item.VALID, next_item.TEST)}
    # The test rows travel with the validation source, for ``test`` at the end.
    made[next_item.VALID].test_source = made[next_item.TEST]
    return made[next_item.TRAIN], made[next_item.VALID]

  def describe_eval(self, *, batch_size: int, eval_batches: int) -> str:
    split = self.split
    rows = min(split.num_users, eval_batches * batch_size)
    seen = "without" if self.mask_seen else "with"
    among = ("the item table's resident items (by raw id; one not resident is a miss)"
             if self.raw_ids else f"all {split.num_items} items")
    return (f"the validation item of {rows} of {split.num_users} users ranked among "
            f"{among} ({seen} their earlier items), HR/NDCG/MRR@"
            f"{list(self.ks)}; the test item at the end")

  def featurize(self, batch: dict) -> dict:
    return _to_int32_offsets(batch, pad=-1 if self.raw_ids else 0)

  def build_model(self, model_config, spec, mesh, *, batch_size: int, rngs):
    return factory.build_model(model_config, spec, mesh=mesh, batch_size=batch_size,
                               dynamic=self.raw_ids, rngs=rngs)

  # -- traced ---------------------------------------------------------------

  def loss(self, model, batch):
    dropout = RowDropout(batch["seed"], self.dropout) if self.dropout else no_dropout
    batch = model.to_rows(batch)  # raw ids: one step of the table's policy, inputs and targets
    hidden = model(batch, dropout)
    logits = model.logits(hidden, batch["items"], vocab_split=True)
    # A dynamic table's logits are its rows, index - 1 (``next_item.NextItemEmbed``).
    shift = int(self.raw_ids)
    labels = jnp.where(batch["targets"] > 0, batch["targets"] - shift, -1)
    table = model.items.rows if self.raw_ids else model.items
    plan = table.plan
    split = {}
    if (not isinstance(logits, logits_lib.VocabShardedLogits) and table.mesh is not None
        and plan.strategy in options.ROW_BLOCKS):
      # Traced on Auto axes the logits carry no layout: name the split.
      split = dict(mesh=table.mesh, vocab_axes=plan.table_axes)
    return vocab_parallel_cross_entropy(logits, labels, reduction="mean", **split)

  def predict(self, model, batch):
    """The 0-based rank of each row's held-out item among all items: int32 ``[B]``.

    Raw ids: among the item table's resident rows; a held-out item that is
    not resident is a miss (the largest int32).
    """
    batch = model.to_rows(batch)  # an eval's lookup admits nothing (dynamic.frozen_maps)
    scores = model.logits(model(batch)[:, -1], batch["items"])
    if self.raw_ids:  # index r + 1 is row r: column 0, padding, is never ranked
      scores = jnp.pad(scores, ((0, 0), (1, 0)))
    ranks = full_ranking.target_ranks(scores, batch["target"], exclude=batch.get("exclude"))
    if self.raw_ids:
      ranks = jnp.where(batch["target"] > 0, ranks, jnp.iinfo(jnp.int32).max)
    return ranks

  # -- host -----------------------------------------------------------------

  def _rank(self, model, batches) -> dict:
    acc = full_ranking.FullRankingMetrics(self.ks)
    for batch in batches:
      ranks = steps.eval_step(model, batch, task=self)
      acc.update(requests.gather(ranks), requests.gather(batch["weight"]))
    result = acc.result()
    if not result.pop("count"):
      raise base.ConfigError("the eval data yielded no row; check config.eval_batches.")
    return result

  def evaluate(self, model, batches, mesh, source) -> dict:
    del mesh, source
    return self._rank(model, batches)

  def test(self, model, eval_source, mesh) -> dict:
    source = eval_source.test_source
    source.set_state({"position": 0})
    batches = (data_lib.to_global_batch(self.featurize(b), mesh) for b in source)
    return {f"test_{k}": v for k, v in self._rank(model, batches).items()}
