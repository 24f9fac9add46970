"""DLRM on Criteo display-advertising logs (13 dense, 26 categorical features).

The MLPerf-style DLRM layout: bottom MLP 13-512-256-64, 26 tables of width 64
(categoricals hashed into ``table_size`` rows each), dot interaction, top MLP
512-256-1; Adam on the MLPs, row-wise AdaGrad on the tables.

    python -m train --config configs/dlrm_criteo.py:/data/day_0.tsv,/data/day_1.tsv \
        --workdir runs/criteo

The argument is ``TRAIN_PATH[,EVAL_PATH]`` (plain or .gz TSV in the Criteo
layout; with one path, 5% of its lines, chosen by a hash of the line
number, are held out of training for eval: ``config.data.eval_holdout``),
or ``smoke`` for a tiny model whose paths are given with
``--config.data.train_path=...`` and ``--config.data.eval_path=...`` (or
``--config.data.eval_holdout=0.05``).
Expected: no full-data run has been measured with this config. The smoke
variant checks the pipeline, not the model: on a 2,000-line file (a
Criteo-format one with a planted label: ``python -m embedlib.data.criteo_synth
day.tsv --lines 2000``),

    python -m train --config configs/dlrm_criteo.py:smoke \
        --config.data.train_path=day.tsv --config.data.eval_holdout=0.05 --workdir /tmp/cr

takes about 25 s on 2 CPU cores (measured: 24 s), most of it compiling.

Input: ``--config.data.workers=N`` parses the training TSV in N grain worker
processes (plain TSV; the batches and checkpoints are the same for every N).
Faster still, convert the TSV once to the binary format and read that:

    python -m embedlib.data.criteo_binary --in /data/day_0.tsv --out /data/day_0.bin \
        --table-sizes 1000000
    python -m train --config configs/dlrm_criteo.py:/data/day_0.bin \
        --config.data.format=binary --workdir runs/criteo

(``--table-sizes`` is the run's ``config.data.table_sizes``; ``--raw-ids``
keeps the 64-bit values for ``raw_ids=True``.) ``benchmarks/README.md`` has
the figures of both.

Raw ids: ``--config.data.raw_ids=True`` reads each categorical value as it
is (no hashing mod ``table_size``) into dynamic tables (``embedlib.DynamicEmbed``)
of ``config.model.dynamic``: ``capacity`` rows each (0: ``data.table_sizes``),
``bucket_size``, ``admit_after``, ``eviction`` (``lru``, ``lfu``, ``none``),
``decay_every``, ``default`` (``zero``, ``learned``). TensorBoard then shows
each table's ``dynamic/.../occupancy``, ``admitted``, ``evicted`` and
``default_share`` (the logging step's). ``smoke_raw`` is ``smoke`` with raw
ids in 256-row tables; ``--config.pipeline=True`` runs it pipelined, with
the in-line run's result.
"""

from configs import parts, quickstart


def get_config(arg=None):
  config = quickstart.get_config()
  config.data.source = "criteo"
  config.data.num_dense = 13
  config.data.table_sizes = (1_000_000,) * 26
  config.data.bag_sizes = ()
  config.data.max_bad_lines = 0

  config.model.embed_dim = 64
  config.model.bottom_sizes = (512, 256)
  config.model.top_sizes = (512, 256, 1)

  config.optim = parts.optimizers(dense_lr=1e-3, sparse_lr=0.05, warmup_steps=1000)
  parts.set_schedule(config, batch_size=2048, num_train_steps=100_000, eval_every=5_000,
                     eval_batches=100)

  if arg in ("smoke", "smoke_raw"):
    config.data.table_sizes = (1_000,) * 26
    config.model.embed_dim = 8
    config.model.bottom_sizes = (16,)
    config.model.top_sizes = (16, 1)
    config.batch_size = 32
    config.num_train_steps = 4
    config.log_every = 2
    config.eval_every = 2
    config.checkpoint_every = 2
    if arg == "smoke_raw":
      config.data.raw_ids = True
      config.model.dynamic.capacity = 256
      config.model.dynamic.bucket_size = 32
  elif arg:
    paths = arg.split(",")
    config.data.train_path = paths[0]
    if len(paths) > 1:
      config.data.eval_path = paths[1]
    else:
      config.data.eval_holdout = 0.05
  return config
