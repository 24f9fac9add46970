"""Quickstart: a small DLRM on the planted synthetic data (the embedded default).

Trains a DLRM (bottom MLP, 8 embedding tables of 100-1,000 rows, one of them
multi-hot, dot interaction, top MLP) with row-wise AdaGrad on the tables and
Adam on the MLPs, on 8 simulated CPU devices with every table sharded (and
padded where its size doesn't divide 8), against labels drawn from a hidden
model whose best achievable AUC is printed as ``oracle_auc``.

    python -m train --config configs/quickstart.py --workdir runs/quickstart

Expected: about a minute on 2 CPU cores (measured: 65 s, with other jobs
sharing the cores); final eval AUC within 0.02 of the oracle AUC (measured:
0.801 vs 0.814). Variants: ``configs/quickstart.py:smoke`` (a few steps,
used by the tests).
"""

import ml_collections

from configs import parts


def get_config(arg=None):
  config = parts.base(dict(name="ctr"))

  config.data = ml_collections.ConfigDict()
  config.data.source = "synthetic"
  config.data.num_dense = 13
  config.data.table_sizes = (1_000, 1_000, 500, 500, 200, 200, 100, 100)
  config.data.bag_sizes = (1, 1, 1, 1, 4, 1, 1, 1)
  config.data.zipf_exponent = 1.1
  config.data.signal_scale = 1.0
  config.data.train_path = ""
  config.data.eval_path = ""
  # Criteo only: evaluate on this fraction of the training lines, held out
  # from training, instead of on eval_path (set exactly one).
  config.data.eval_holdout = 0.0
  # Malformed Criteo lines to skip before stopping; -1 skips them all.
  config.data.max_bad_lines = 0
  config.data.prefetch = 2
  # Criteo only: "tsv" (plain or .gz files) or "binary" (a directory written once from the
  # TSV by python -m embedlib.data.criteo_binary, read memory-mapped).
  config.data.format = "tsv"
  # Criteo TSV only: parse the training lines in this many grain worker processes (0: here).
  config.data.workers = 0
  # Ids as they are, into dynamic tables of config.model.dynamic (DLRM, DCN).
  config.data.raw_ids = False

  config.model = ml_collections.ConfigDict()
  config.model.name = "dlrm"
  config.model.embed_dim = 16
  config.model.bottom_sizes = (64, 32)
  config.model.top_sizes = (64, 32, 1)
  config.model.combiner = "sum"
  config.model.cross_layers = 3
  # Dedup (embedlib.EmbeddingCollection's num_unique): None (off), distinct ids a data
  # shard holds (an int), or "auto" (where the planner finds it pays).
  config.model.num_unique = ml_collections.config_dict.placeholder(object)
  # How much each table's ids repeat, for that plan: None (uniform ids), a Zipf exponent
  # for every table, or "fit": fitted to the first training batch (saved in the workdir).
  config.model.id_skew = ml_collections.config_dict.placeholder(object)
  config.model.kernel = "auto"
  # Tables up to this many bytes are replicated (None: the library default).
  config.model.replicate_below_bytes = 0
  # The dynamic tables of config.data.raw_ids (embedlib.DynamicEmbed); capacity 0: table_sizes.
  config.model.dynamic = ml_collections.ConfigDict(dict(
      capacity=0, bucket_size=128, admit_after=1, eviction="lru", decay_every=0,
      default="zero"))

  config.optim = parts.optimizers(dense_lr=2e-3, sparse_lr=0.3, warmup_steps=50)
  parts.set_schedule(config, batch_size=1024, num_train_steps=1200, eval_every=400,
                     eval_batches=8)

  if arg == "smoke":
    config.data.table_sizes = (100, 100, 50, 50, 20, 20, 10, 10)
    parts.set_smoke_schedule(config, batch_size=64)
  elif arg not in (None, ""):
    raise ValueError(f"configs/quickstart.py has no variant {arg!r}; use ':smoke' or none.")
  return config
