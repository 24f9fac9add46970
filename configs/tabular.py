"""Your own logs: DLRM, DCN-v2, the transformer ranker or two towers, from the files' schema.

Reads a Parquet file (or a directory or glob of them), a CSV / TSV file
with a header, or a RecBole ``.inter`` file with its ``.user`` / ``.item``
files beside it; infers each column's role and type (string and int ids,
lists, floats), takes what you declare over it, and trains the model named
by ``config.model.name`` on it:

    python -m train --config configs/tabular.py:PATH --config.data.label=NAME \\
        [--config.data.label_threshold=T] [--config.data.eval_path=PATH2] \\
        [--config.model.name=dlrm|dcn_v2|two_tower|ranker] --workdir W

For example, ML-100K as RecBole ships it (ratings of 4 and 5 are clicks,
every side column of the users and movies read; RecBole's random 8:1:1
split, the test tenth scored once at the end as ``test_*``):

    python -m train --config configs/tabular.py:ml-100k/ml-100k.inter \\
        --config.data.label=rating --config.data.label_threshold=4 --workdir runs/ml100k

The schema (printed at the start, saved as ``schema.json`` in the workdir
with the training split's statistics) says how each column is read: id
columns (``categorical``, ``categorical_list``, ``user_id``, ``item_id``)
get an embedding table each, a vocabulary of the training values if they
have at most 100,000 distinct ones, else a dynamic table of raw 64-bit ids
(``embedlib.DynamicEmbed``; string ids hashed, ``embedlib.tabular.hashing``);
floats are dense inputs, standardized. Change any column with
``config.data.columns``, e.g. in a config of your own::

    config.data.columns = {"price": {"role": "dense", "dtype": "float",
                                     "transform": "log1p", "default": 0.0},
                           "device": {"role": "categorical", "dtype": "string",
                                      "ids": "hashed", "num_embeddings": 1000}}

or as JSON on the command line,
``--config.data.columns='{"price": {"transform": "log1p"}, "user_id": {"ids": "dynamic"}}'``;
or with the shorthands ``--config.data.dense=hour,age``, ``--config.data.ignore=notes``,
``--config.data.user_columns=age,gender``, ``--config.data.item_columns=categories``
(the two towers' sides; a RecBole dataset's ``.user`` and ``.item`` columns are
already), ``--config.data.user_id=uid`` and ``--config.data.item_id=sku``
(default: the columns named ``user_id`` and ``item_id``).

Splits: ``data.split='hash'`` (``eval_fraction``, ``test_fraction``, by a
hash of the row number), ``'time'`` (``split_time``, ``test_time``, by the
``timestamp`` column), or an ``eval_path`` (and ``test_path``) of their own.

Training length: ``data.num_epochs`` passes over the training rows, an eval
each epoch (``eval_every=0``), stopping early after ``early_stopping`` evals
without a better eval AUC (two towers: recall at the least K of
``task.recall_ks``); the test rows are then scored with the best eval's
weights. Expected on ML-100K with every side
column, 2 CPU cores: see docs/guides/your_data.md.

Variants: ``:smoke`` (tiny model and schedule; give ``--config.data.path``).
The argument is the data path, or ``smoke[,PATH]``.
"""

import ml_collections

from configs import parts


def get_config(arg=None):
  config = parts.base(dict(name="tabular", recall_ks=(10, 50, 100)))
  config.data = ml_collections.ConfigDict()
  config.data.path = ""
  config.data.eval_path = ""
  config.data.test_path = ""
  config.data.format = "auto"  # parquet, csv, recbole
  config.data.delimiter = ""  # "": ',' (tab for .tsv)
  config.data.list_separator = "|"  # a CSV list column's values
  config.data.label = ""  # the label column (several: "a,b")
  config.data.label_threshold = ml_collections.config_dict.placeholder(float)
  config.data.user_id = ""
  config.data.item_id = ""
  config.data.timestamp = ""
  config.data.user_columns = ""
  config.data.item_columns = ""
  config.data.dense = ""
  config.data.ignore = ""
  # {column: {field: value}} or its JSON text: a ConfigDict would take neither JSON's
  # null nor a column name with a dot.
  config.data.columns = ml_collections.config_dict.placeholder(object)
  config.data.split = "hash"
  config.data.eval_fraction = 0.1
  config.data.test_fraction = 0.1
  config.data.split_time = 0.0
  config.data.test_time = 0.0
  config.data.split_seed = 0
  config.data.workers = 0
  config.data.prefetch = 2
  config.data.num_epochs = 20

  config.model = ml_collections.ConfigDict()
  config.model.name = "dlrm"
  config.model.embed_dim = 32
  # Small initial rows: with the tables' default (variance 1 / embed_dim) the
  # many rarely seen ids start as noise the model then fits.
  config.model.embed_init_std = 0.01
  config.model.combiner = "mean"
  config.model.bottom_sizes = (64,)
  config.model.top_sizes = (128, 64, 1)
  config.model.cross_layers = 3
  # the ranker
  config.model.width = 32
  config.model.num_layers = 2
  config.model.num_heads = 2
  config.model.mlp_ratio = 2
  # the two towers
  config.model.tower_sizes = (64, 32)
  config.model.temperature = 0.05
  config.model.kernel = "auto"
  config.model.num_unique = ml_collections.config_dict.placeholder(object)
  config.model.replicate_below_bytes = 0
  # Dynamic tables (columns of raw ids); each column's capacity is in its schema.
  config.model.dynamic = ml_collections.ConfigDict(dict(
      bucket_size=128, admit_after=1, eviction="lru", decay_every=0, default="zero"))

  config.optim = parts.optimizers(dense_lr=1e-3, sparse_lr=0.05, warmup_steps=100)
  config.optim.dense.schedule = "constant"
  parts.set_schedule(config, batch_size=1024, num_train_steps=0, eval_every=0,
                     eval_batches=1_000_000, log_every=50)
  config.early_stopping = 3

  smoke, _, path = (arg or "").partition(",")
  if smoke == "smoke":
    config.data.path = path
    parts.set_smoke_schedule(config, batch_size=64)
    config.model.embed_dim = 8
    config.model.bottom_sizes = (8,)
    config.model.top_sizes = (16, 1)
    config.model.width = 8
    config.model.tower_sizes = (16, 8)
  elif arg:
    config.data.path = arg
  return config
