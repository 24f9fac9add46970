"""MovieLens: SASRec or HSTU (next item), the two towers or the ranker (ratings as actions).

Reads a MovieLens release as downloaded (ML-100K's folder, ML-1M's
``ratings.dat``, ML-20M's ``ratings.csv``, ...) or RecBole's atomic files,
orders each user's ratings by time and holds out the last (test) and the
one before it (validation), as the SASRec paper and RecBole do. Every
rating is an interaction. The model reads a user's last 50 movies and
scores every movie as the next one through the tied item table (a softmax
over the whole vocabulary); the eval ranks each user's held-out movie among
all movies: HR, NDCG and MRR @10 and @20 on validation at each eval, on
test at the end (``test_*`` in ``eval.jsonl``).

    python -m train --config configs/movielens.py:/path/to/ml-100k --workdir runs/sasrec \
        --cpu_devices=1
    python -m train --config configs/movielens.py:hstu,/path/to/ml-100k --workdir runs/hstu \
        --cpu_devices=1

The same split trains the library's request models, ratings as actions
(``rated``; ``liked``: 4 stars or more), with a user's last 50 movies as
the history:

    python -m train --config configs/movielens.py:two_tower,/path/to/ml-100k \
        --workdir runs/two_tower --cpu_devices=1
    python -m train --config configs/movielens.py:ranker,/path/to/ml-100k \
        --workdir runs/ranker --cpu_devices=1

``two_tower`` (the ``retrieval`` task) learns from each training rating's
history and movie with in-batch negatives, and is evaluated as SASRec is:
each user's held-out movie ranked among all movies through the item tower.
``ranker`` (the ``ranking`` task) scores the movie rated next among 7 the
user has not rated, per action; its eval ranks the held-out movie among 100
the user never rated (the SASRec paper's sampled protocol), per-action AUC
and NDCG@10.

Raw ids: ``--config.data.raw_ids=True`` reads the file's own user and
movie ids, not numbered densely, into dynamic tables
(``embedlib.DynamicEmbed``) of ``config.model.dynamic``: one entry per
table, ``item`` (required; SASRec's and HSTU's only one, tied to the
output) and ``user`` (``two_tower`` and ``ranker``, optional; without it
the raw user ids are hashed), each with ``capacity``, ``bucket_size``,
``admit_after``, ``eviction`` (``lru``, ``lfu``, ``none``), ``decay_every``
and ``default`` (docs/guides/dynamic_tables.md); the capacities here fit
ML-100K, so raise them for a larger release (ML-1M's 3,706 movies:
``--config.model.dynamic.item.capacity=8192``). The history's movies read
the same item table as the candidates. The two towers' eval then ranks the
item table's resident movies only, and so do SASRec's and HSTU's: a
held-out movie that is not resident can't be retrieved and counts as a
miss.

The argument is ``[MODEL,]PATH``: ``sasrec`` (the default), ``hstu``,
``two_tower`` or ``ranker``, and the folder or ratings file. Expected on
ML-100K with one device on 2 shared CPU cores, test NDCG@10 over three
seeds with seen movies ranked (RecBole's protocol for sequential models):
SASRec 31 epochs in 8.6 min, 0.1006; HSTU 35 epochs in 4.8 min, 0.1038
(RecBole's BPR, its evaluation leaving seen movies out, 0.0583); without
the learned repeat bias (``--config.model.repeat_bias=False``) 0.0580 and
0.0603. One seed: two towers 10 epochs in 80 s, 0.0499 (0.0859 with
``--config.task.mask_seen=True``); the ranker 3 epochs in 11 min, NDCG@10
among 101 0.378, AUC 0.894 (rated) and 0.907 (liked). The tables, and
other settings: docs/guides/movielens.md.
Variants: ``:smoke``, ``:smoke,hstu``, ``:smoke,two_tower`` or
``:smoke,ranker`` (a few steps of a tiny model, used by the tests; set
``--config.data.path``).
"""

import ml_collections

from configs import parts
from embedlib.data.movielens_requests import ACTIONS

MODELS = ("sasrec", "hstu", "two_tower", "ranker")
#: Models that read requests (a history and what comes next), not next-item windows.
REQUEST_MODELS = ("two_tower", "ranker")


def _parse(arg):
  """``(model, path, smoke)`` of ``[MODEL,]PATH`` or ``smoke[,MODEL]``."""
  parts_ = (arg or "").split(",", 1)
  if parts_[0] == "smoke":
    model = parts_[1] if len(parts_) > 1 else "sasrec"
    path, smoke = "", True
  elif len(parts_) > 1 and parts_[0] in MODELS:
    model, path, smoke = parts_[0], parts_[1], False
  else:
    model, path, smoke = "sasrec", arg or "", False
  if model not in MODELS:
    raise ValueError(f"configs/movielens.py: model {model!r}; use one of {MODELS}, e.g. "
                     "configs/movielens.py:hstu,/path/to/ml-100k.")
  return model, path, smoke


def get_config(arg=None):
  model, path, smoke = _parse(arg)
  if model in REQUEST_MODELS:
    return _requests_config(model, path, smoke)
  config = parts.base(dict(
      name="sequential",
      # RecBole ranks sequential models' targets among every item, seen or not.
      mask_seen=False,
      ks=(10, 20)))
  config.data = ml_collections.ConfigDict(dict(
      source="movielens", path=path, max_len=50,
      # Targets per training window (at most max_len); the window's items
      # before them are context only, so every target sees at least
      # max_len - stride earlier ones.
      stride=50, prefetch=2,
      # The file's movie ids as they are, into the dynamic item table of
      # config.model.dynamic.item.
      raw_ids=False,
      # SASRec and HSTU: the .item file's columns read beside each movie's id
      # (RecBole's atomic files), e.g. "class,release_year".
      item_columns=""))
  config.model = ml_collections.ConfigDict(dict(
      name=model,
      width=64,
      num_layers=2,
      num_heads=2,
      # SASRec's MLP (4 x 64 = RecBole's inner_size 256); HSTU has none.
      mlp_ratio=4,
      # HSTU's time bias: buckets of log |gap|.
      num_time_buckets=128,
      scale_embeddings=False,
      # A learned logit for the items in the model's own input: without it a
      # tied SASRec ranks the movies it is reading among its top ten
      # (embedlib.models.next_item).
      repeat_bias=True,
      dropout=0.5,
      # Read with config.data.raw_ids: rows for ML-100K's 1,682 movies with
      # room to spare (the buckets fill unevenly, and a full one evicts).
      dynamic=ml_collections.ConfigDict(dict(item=parts.dynamic_table(capacity=4096))),
      kernel="auto",
      replicate_below_bytes=None))
  # The tied item table trains with the dense optimizer: optim.sparse goes unused.
  config.optim = parts.optimizers(dense_lr=2e-3, sparse_lr=0.1, warmup_steps=0)
  config.optim.dense.schedule = "constant"
  # eval_batches covers every user.
  if model == "sasrec":
    # Windows end every 25 ratings, each target seeing at least 25 earlier
    # ones: on ML-100K an epoch is 34 batches of 128 windows; 31 epochs.
    config.data.stride = 25
    parts.set_schedule(config, batch_size=128, num_train_steps=1050, eval_every=175,
                       eval_batches=10_000, log_every=35)
  else:
    # An epoch of ML-100K is 38 batches of 64 windows; 35 epochs.
    parts.set_schedule(config, batch_size=64, num_train_steps=1330, eval_every=190,
                       eval_batches=10_000, log_every=95)

  if smoke:
    config.data.update(max_len=8, stride=8)
    config.model.update(width=16, num_layers=1, num_heads=2, mlp_ratio=2,
                        num_time_buckets=16, dropout=0.2,
                        # Split the tiny table, so the smoke run takes the sharded path.
                        replicate_below_bytes=0)
    # 4 buckets of 32 per device of 8.
    config.model.dynamic.item.update(capacity=1024, bucket_size=32)
    parts.set_smoke_schedule(config, batch_size=16)
  return config


def _requests_config(model, path, smoke):
  """The two towers (``retrieval``) or the ranker (``ranking``) on MovieLens requests."""
  data = ml_collections.ConfigDict(dict(
      source="movielens", path=path,
      # The user's last 50 movies, SASRec's window.
      history_len=50,
      # Ratings are actions: every rating is "rated", one of 4 or 5 stars "liked".
      actions=ACTIONS, like_rating=4.0, prefetch=2,
      # The file's ids as they are, into the dynamic tables of config.model.dynamic.
      raw_ids=False))
  # Rows for ML-100K's 1,682 movies and 943 users with room to spare: the
  # buckets fill unevenly, and a full one evicts.
  dynamic = ml_collections.ConfigDict(dict(item=parts.dynamic_table(capacity=4096),
                                           user=parts.dynamic_table(capacity=2048)))
  if model == "two_tower":
    config = parts.base(dict(
        name="retrieval",
        log_q="streaming",
        remove_accidental_hits=True,
        frequency_buckets=1 << 12,
        frequency_alpha=0.05,
        corpus_chunk=1 << 16,
        # The full ranking of the sequential models: every movie, seen or not.
        ks=(10, 20),
        mask_seen=False))
    config.data = data
    config.model = ml_collections.ConfigDict(dict(
        name="two_tower",
        user_tower="pooled",
        features=64,
        tower_sizes=(128,),
        temperature=0.05,
        min_temperature=0.01,
        max_temperature=1.0,
        learn_temperature=True,
        # 2 hashes into 4k rows: a few collisions among ML-100K's 1,682 movies, none
        # sharing both rows.
        item_hash=parts.multi_hash(num_buckets=1 << 12, features=32, seed=1),
        user_hash=parts.multi_hash(num_buckets=1 << 12, features=16, seed=0),
        author_features=4,
        action_features=8,
        **parts.transformer(num_layers=1),
        dynamic=dynamic,
        kernel="auto",
        replicate_below_bytes=None))
    config.optim = parts.optimizers(dense_lr=2e-3, sparse_lr=0.1, warmup_steps=100)
    # On ML-100K an epoch is 97,328 requests, 381 batches of 256; 10 epochs.
    parts.set_schedule(config, batch_size=256, num_train_steps=3810, eval_every=762,
                       eval_batches=10_000, log_every=127)
  else:
    config = parts.base(dict(
        name="ranking",
        loss_weights=(1.0, 1.0),
        # The held-out movie is the one gain of its request: NDCG@10 is the SASRec
        # paper's sampled NDCG@10 whatever the weights.
        ndcg_weights=(1.0, 1.0),
        ndcg_k=10))
    config.data = data
    config.data.update(num_candidates=8, eval_candidates=101)
    config.model = ml_collections.ConfigDict(dict(
        name="ranker",
        **parts.transformer(num_layers=2),
        item_features=32,
        author_features=4,
        action_features=8,
        user_hash=parts.multi_hash(num_buckets=1 << 12, features=16, seed=0),
        dynamic=dynamic,
        kernel="auto",
        replicate_below_bytes=None))
    config.optim = parts.optimizers(dense_lr=2e-3, sparse_lr=0.1, warmup_steps=100)
    # On ML-100K an epoch is 381 batches of 256 requests; 3 epochs.
    parts.set_schedule(config, batch_size=256, num_train_steps=1143, eval_every=381,
                       eval_batches=10_000, log_every=127)

  if smoke:
    config.data.history_len = 8
    config.model.update(width=16, num_layers=1, author_features=2, action_features=4,
                        # Split the tiny tables, so the smoke run takes the sharded path.
                        replicate_below_bytes=0)
    config.model.user_hash.update(num_buckets=256, features=8)
    for table in config.model.dynamic.values():  # 4 buckets of 32 per device of 8
      table.update(capacity=1024, bucket_size=32)
    if model == "two_tower":
      config.model.update(features=8, tower_sizes=(16,))
      config.model.item_hash.update(num_buckets=256, features=8)
      config.task.update(frequency_buckets=256)
    else:
      config.model.item_features = 8
      config.data.update(num_candidates=4, eval_candidates=11)
    parts.set_smoke_schedule(config, batch_size=16)
  return config
