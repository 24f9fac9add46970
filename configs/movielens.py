"""Next-item recommendation on MovieLens: SASRec or HSTU, full ranking over every movie.

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

The argument is ``[MODEL,]PATH``: ``sasrec`` (the default) or ``hstu``, and
the folder or ratings file. Expected on ML-100K with one device on 2 CPU
cores shared with other jobs (load average 10 to 14): SASRec 30 epochs in
22 min, test NDCG@10 0.0592 (0.1049 with ``--config.task.mask_seen=True``,
the protocol of RecBole's BPR, which reaches 0.060 to 0.067 here); HSTU 35
epochs in 8.1 min, 0.0638 (0.1100). The table, and other settings:
docs/guides/movielens.md.
Variants: ``:smoke`` or ``:smoke,hstu`` (a few steps of a tiny model, used
by the tests; set ``--config.data.path``).
"""

import ml_collections

from configs import parts

MODELS = ("sasrec", "hstu")


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
      stride=50, prefetch=2))
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
      dropout=0.5,
      kernel="auto",
      replicate_below_bytes=None))
  # The tied item table trains with the dense optimizer: optim.sparse goes unused.
  config.optim = parts.optimizers(dense_lr=2e-3, sparse_lr=0.1, warmup_steps=0)
  config.optim.dense.schedule = "constant"
  # eval_batches covers every user.
  if model == "sasrec":
    # Windows end every 25 ratings, each target seeing at least 25 earlier
    # ones: on ML-100K an epoch is 35 batches of 128 windows; 30 epochs.
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
    parts.set_smoke_schedule(config, batch_size=16)
  return config
