"""Quantized tables: each task's eval metric and table bytes, float32 vs bf16 / fp8 / int8 / int4.

    python benchmarks/quantized.py                       # quickstart DLRM, AUC
    python benchmarks/quantized.py --model criteo        # configs/dlrm_criteo.py, AUC
    python benchmarks/quantized.py --model two_tower     # configs/two_tower.py, recall@100
    python benchmarks/quantized.py --model sasrec        # configs/movielens.py, NDCG@10
    python benchmarks/quantized.py --model criteo --smoke   # a few steps (tests)
    python benchmarks/quantized.py --json run.json       # also the run's record (timing.Run)

Trains the model with ``train_and_evaluate`` into a temporary workdir for
``--steps`` (shorter than the config's schedule; the defaults keep a run to
a few minutes on 2 CPU cores), restores it, and evaluates it on the same
eval batches as float32 and after ``embedlib.quantize`` with each format
(the tables only: MLPs, towers and attention stay float32). Prints per
format the task's metric, its difference to float32 (issue 39's targets
for DLRM AUC: int8 within 0.001, int4 within 0.005), and the bytes of the
stored (padded) tables with the ratio to float32.

The data: ``quickstart`` and ``two_tower`` read their planted sources;
``criteo`` writes a Criteo-format file with a planted label
(``embedlib.data.criteo_synth``, ``--lines`` of it, 5% held out for eval)
and keeps the config's model (26 tables of width 64, MLPs 512-256 and
512-256-1) with ``--rows`` rows a table (the config's 1,000,000 at
``--rows 1000000``, 6.7 GB of float32 tables); ``sasrec`` reads the
MovieLens release ``--data`` names (ML-100K: RecBole's wheel carries it, at
``.peers/lib/python3.11/site-packages/recbole/dataset_example/ml-100k``), or
without it writes a ``u.data`` whose users walk a planted ring of items
(``planted_movielens``).

SASRec ties its item table to its output layer: quantized, the table serves
both its lookups and the logits over every item (``QuantizedEmbed.attend``,
which scores each shard from its codes), as an exported artifact does.

``--json FILE`` keeps each format's metric (unit: the metric's name) and
table bytes (MiB) in ``benchmarks/timing.py``'s record, with the named
figures ``<format>_metric_diff`` (the format's metric less float32's) and
``<format>_bytes_over_float32``; nothing is timed, the machine's state is
recorded all the same.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import embedlib  # noqa: E402
from configs import dlrm_criteo, movielens, quickstart, two_tower  # noqa: E402
from embedlib.data import criteo_synth  # noqa: E402
from embedlib.training import setup, train_lib  # noqa: E402
import timing  # noqa: E402

FORMATS = ("bf16", "fp8", 8, 4)
#: The metric each model's row shows (a key of the task's eval dict).
METRIC = {"quickstart": "auc", "criteo": "auc", "two_tower": "recall@100", "sasrec": "ndcg@10"}
#: Steps when --steps is not given: a few minutes each on 2 CPU cores.
STEPS = {"quickstart": 400, "criteo": 300, "two_tower": 400, "sasrec": 300}


def table_bytes(model) -> int:
  """Bytes of every table in ``model`` as stored: padded rows, codes plus scales and biases."""
  total = 0
  for _, m in nnx.iter_graph(model):
    if isinstance(m, embedlib.QuantizedEmbed):
      total += m.nbytes
    elif isinstance(m, embedlib.ShardedEmbed):
      t = m.physical_table()
      total += t.size * t.dtype.itemsize
  return total


def planted_movielens(folder: str, *, num_users: int, num_items: int, seed: int = 0) -> str:
  """A GroupLens ``u.data`` whose users walk a ring of items: a next item SASRec can learn.

  Each user starts at a random item and steps 1, 2 or 3 items around the
  ring (probabilities 0.5, 0.3, 0.2), or, one time in five, jumps to a
  random item; 20 to 80 ratings a user, an hour apart.
  """
  rng = np.random.default_rng(seed)
  os.makedirs(folder, exist_ok=True)
  lines = []
  for user in range(1, num_users + 1):
    item = int(rng.integers(num_items))
    for t in range(int(rng.integers(20, 81))):
      lines.append(f"{user}\t{item + 1}\t{rng.integers(1, 6)}\t{880_000_000 + 3600 * t}\n")
      if rng.random() < 0.2:
        item = int(rng.integers(num_items))
      else:
        item = (item + int(rng.choice(3, p=(0.5, 0.3, 0.2))) + 1) % num_items
  with open(os.path.join(folder, "u.data"), "w") as f:
    f.writelines(lines)
  return folder


def make_config(model: str, data_dir: str, args):
  """The config ``model`` trains under, its data written to ``data_dir``; and a one-line note."""
  if model == "quickstart":
    config = quickstart.get_config("smoke" if args.smoke else None)
    note = "quickstart DLRM (8 tables, planted synthetic data)"
  elif model == "criteo":
    config = dlrm_criteo.get_config("smoke" if args.smoke else None)
    path = os.path.join(data_dir, "day.tsv")
    lines = 2_000 if args.smoke else args.lines
    criteo_synth.CriteoSynth(seed=0).write(path, lines)
    config.data.train_path, config.data.eval_holdout = path, 0.05
    if not args.smoke:
      config.data.table_sizes = (args.rows,) * 26
      config.batch_size = args.batch_size
      config.optim.dense.warmup_steps = args.steps // 10
    rows = config.data.table_sizes[0]
    note = (f"Criteo DLRM (26 tables of {rows:,} x {config.model.embed_dim}, criteo_synth "
            f"{lines:,} lines, 5% held out)")
  elif model == "two_tower":
    config = two_tower.get_config("smoke" if args.smoke else None)
    if args.smoke:
      config.task.recall_ks = (1, 10, 100)
    note = f"two-tower retrieval ({config.data.num_items:,}-item catalogue, planted requests)"
  elif model == "sasrec":
    config = movielens.get_config("smoke" if args.smoke else None)
    if args.data:
      config.data.path = args.data
      note = f"SASRec next item ({args.data})"
    else:
      users, items = (40, 60) if args.smoke else (args.users, args.items)
      config.data.path = planted_movielens(os.path.join(data_dir, "ml"), num_users=users,
                                           num_items=items)
      note = f"SASRec next item (planted ring: {users:,} users, {items:,} items, 20-80 each)"
  else:
    raise ValueError(f"--model={model!r}; use one of {', '.join(METRIC)}.")
  if not args.smoke:
    config.num_train_steps = args.steps
    config.eval_every = config.checkpoint_every = args.steps
    if args.eval_batches:
      config.eval_batches = args.eval_batches
  return config, note


def measure(model_name: str, args) -> list[tuple[str, dict, int]]:
  """``[(format, eval metrics, table bytes)]``, float32 first, after training ``model_name``."""
  with tempfile.TemporaryDirectory() as data_dir, tempfile.TemporaryDirectory() as workdir:
    config, note = make_config(model_name, data_dir, args)
    train_lib.train_and_evaluate(config, workdir)
    model, mesh = setup.restore_model(config, workdir)
    task = setup.task(config)
    _, eval_source = setup.sources(config, task, task.data_spec())
    start = eval_source.get_state()

    def score(m):
      if hasattr(m, "eval"):
        m.eval()
      return train_lib.evaluate(m, eval_source, start, mesh, config.eval_batches, task)

    rows = [("float32", score(model), table_bytes(model))]
    for bits in FORMATS:
      quantized = embedlib.quantize(nnx.clone(model), bits)
      rows.append((str(bits), score(quantized), table_bytes(quantized)))
  print(f"\n{note}: {config.num_train_steps} steps of {config.batch_size}, eval "
        f"{config.eval_batches} batches; jax {jax.__version__}")
  return rows


def report(model_name: str, rows, record=None) -> None:
  metric = METRIC[model_name]
  base, base_bytes = rows[0][1][metric], rows[0][2]
  print(f"{'tables':>8} {metric:>10} {'diff':>9} {'bytes':>14} {'ratio':>6}")
  for name, metrics, size in rows:
    print(f"{name:>8} {metrics[metric]:10.5f} {metrics[metric] - base:+9.5f} {size:14,d} "
          f"{size / base_bytes:6.3f}")
    if record is not None:
      record.add_case(f"{name}: {metric}", float(metrics[metric]), metric)
      record.add_case(f"{name}: table bytes", size / 2**20, "MiB")
      if name != "float32":
        record.ratio(f"{name}_metric_diff", float(metrics[metric] - base))
        record.ratio(f"{name}_bytes_over_float32", size / base_bytes)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=tuple(METRIC), default="quickstart")
  parser.add_argument("--steps", type=int, default=None, help="default: per model (STEPS)")
  parser.add_argument("--eval-batches", type=int, default=None, help="default: the config's")
  parser.add_argument("--rows", type=int, default=100_000, help="criteo: rows a table")
  parser.add_argument("--lines", type=int, default=320_000, help="criteo: lines of data")
  parser.add_argument("--batch-size", type=int, default=1024, help="criteo: the batch")
  parser.add_argument("--data", default=None,
                      help="sasrec: a MovieLens folder or file (default: a planted ring)")
  parser.add_argument("--users", type=int, default=1_000, help="sasrec: planted users")
  parser.add_argument("--items", type=int, default=2_000, help="sasrec: planted items")
  parser.add_argument("--smoke", action="store_true", help="the config's smoke variant")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  record = timing.Run("quantized", argv, smoke=args.smoke)
  if args.steps is None:
    args.steps = STEPS[args.model]
  if args.model == "quickstart" and args.eval_batches is None and not args.smoke:
    args.eval_batches = 16
  report(args.model, measure(args.model, args), record)
  record.finish(args.json)


if __name__ == "__main__":
  main()
