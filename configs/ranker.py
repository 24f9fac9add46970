"""Transformer ranker with candidate isolation on planted ranking requests.

Each request is a user, up to 32 history events (item, author, multi-hot
actions) and up to 16 candidates, each labelled with 5 actions (click,
like, reply, share, dwell) drawn from a hidden model that depends on the
history (which topics and authors the user engaged with), the item's
hidden quality and the user's activity. The ranker embeds
``[user | history | candidates]`` (a 100k-row item table sharded over the
8 simulated devices and trained with row-wise AdaGrad; a multi-hash user
table), runs 2 transformer layers in which candidates see only the user,
the history and themselves, and predicts 5 logits per candidate. The eval
prints per-action AUC and NDCG@8 beside the planted optimum's (``oracle_*``).

    python -m train --config configs/ranker.py --workdir runs/ranker

Expected: about 4 minutes on 2 CPU cores (measured: 4 min 33 s with the
cores shared at load average 16-22, 3 min 53 s at load 11); final eval
NDCG@8 0.760 against the planted optimum's 0.795 (96%), mean per-action
AUC 0.732 against 0.765 (87% of the optimum's lift over 0.5); per action
(click, like, reply, share, dwell) 0.683 / 0.748 / 0.726 / 0.787 / 0.713
against 0.715 / 0.785 / 0.784 / 0.811 / 0.732.
Variants: ``configs/ranker.py:smoke`` (a few steps of a tiny model, used by
the tests), ``:causal`` (the history attends causally).
"""

import ml_collections

from configs import parts


def get_config(arg=None):
  config = parts.base(dict(
      name="ranking",
      loss_weights=(1.0, 1.0, 1.0, 1.0, 1.0),
      # NDCG's gain per action: a reply or a share counts more than a click.
      ndcg_weights=(1.0, 2.0, 3.0, 3.0, 1.0),
      ndcg_k=8))
  config.data = parts.planted_requests("planted_ranking", num_candidates=16)
  config.model = ml_collections.ConfigDict(dict(
      name="ranker",
      **parts.transformer(num_layers=2),
      item_features=32,
      author_features=16,
      action_features=8,
      user_hash=parts.multi_hash(num_buckets=1 << 14, features=16, seed=0),
      kernel="auto",
      # Tables up to this many bytes are replicated (None: the library default).
      replicate_below_bytes=0))
  config.optim = parts.optimizers(dense_lr=3e-3, sparse_lr=0.2, warmup_steps=100)
  parts.set_schedule(config, batch_size=256, num_train_steps=1200, eval_every=400,
                     eval_batches=8)

  if arg == "smoke":
    parts.smoke_requests(config.data, num_items=1_000, num_candidates=4)
    config.task.ndcg_k = 4
    config.model.update(width=16, num_layers=1, item_features=8, author_features=4,
                        action_features=4)
    config.model.user_hash.update(num_buckets=256, features=8)
    parts.set_smoke_schedule(config)
  elif arg == "causal":
    config.model.causal = True
  elif arg not in (None, ""):
    raise ValueError(f"configs/ranker.py has no variant {arg!r}; use ':smoke', ':causal' "
                     "or none.")
  return config
