"""Two-tower retrieval on planted requests, recall@K over a 100k-item catalogue.

Each request is a user and up to 32 history events (item, author,
multi-hot actions); the item it engages with next is drawn from the
topics of its engaged history, by popularity within the topic. The user
tower pools the history's event embeddings with the user's multi-hash
embedding (``:trunk`` runs the transformer ranker's trunk instead); the
candidate tower embeds the item by 2 hashes into a 64k-row table and its
author. Both are L2-normalised; the softmax over the global batch's items
has a learnable temperature, a streaming log-Q correction and accidental
hits removed. The eval embeds all 100k items, sharded over the 8
simulated devices, and finds each eval request's top 100 exactly; recall@
{1, 10, 100} is printed beside the planted optimum's (``oracle_recall@K``).

    python -m train --config configs/two_tower.py --workdir runs/two_tower

Expected: about 3.5 minutes on 2 CPU cores (measured: 3 min 37 s with the
cores shared, load average 16-19); final recall@1 / @10 / @100 0.033 /
0.127 / 0.291 against the planted optimum's 0.039 / 0.156 / 0.391 (86%,
82% and 74% of it). ``--config.task.log_q=batch`` reaches 0.033 / 0.068 /
0.117, ``=none`` 0.000 / 0.001 / 0.029.
Variants: ``configs/two_tower.py:smoke`` (a few steps on a small
catalogue, used by the tests), ``:trunk`` (the transformer user tower).
"""

import ml_collections

from configs import parts


def get_config(arg=None):
  config = parts.base(dict(
      name="retrieval",
      # "streaming" (Yi et al. 2019), "batch" (counts in the batch) or "none".
      log_q="streaming",
      remove_accidental_hits=True,
      recall_ks=(1, 10, 100),
      frequency_buckets=1 << 17,
      frequency_alpha=0.05,
      corpus_chunk=1 << 16))
  config.data = parts.planted_requests("planted_retrieval")
  config.model = ml_collections.ConfigDict(dict(
      name="two_tower",
      user_tower="pooled",
      features=32,
      tower_sizes=(64,),
      temperature=0.05,
      min_temperature=0.01,
      max_temperature=1.0,
      learn_temperature=True,
      item_hash=parts.multi_hash(num_buckets=1 << 16, features=32, seed=1),
      user_hash=parts.multi_hash(num_buckets=1 << 14, features=16, seed=0),
      author_features=16,
      action_features=8,
      # The trunk user tower (user_tower="trunk"): the ranker's transformer.
      **parts.transformer(num_layers=1),
      kernel="auto",
      replicate_below_bytes=0))
  config.optim = parts.optimizers(dense_lr=3e-3, sparse_lr=0.2, warmup_steps=100)
  parts.set_schedule(config, batch_size=1024, num_train_steps=1600, eval_every=800,
                     eval_batches=4)

  if arg == "smoke":
    parts.smoke_requests(config.data, num_items=2_000)
    config.task.update(recall_ks=(1, 10), frequency_buckets=1024, corpus_chunk=1024)
    config.model.update(features=8, tower_sizes=(16,), author_features=4, action_features=4,
                        width=16)
    config.model.item_hash.update(num_buckets=1024, features=8)
    config.model.user_hash.update(num_buckets=256, features=8)
    parts.set_smoke_schedule(config)
  elif arg == "trunk":
    config.model.user_tower = "trunk"
  elif arg not in (None, ""):
    raise ValueError(f"configs/two_tower.py has no variant {arg!r}; use ':smoke', ':trunk' "
                     "or none.")
  return config
