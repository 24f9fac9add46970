"""DLRM training throughput: embedlib beside TorchRec's fused row-wise AdaGrad, in one run.

    python3 benchmarks/train_dlrm.py              # full run
    python3 benchmarks/train_dlrm.py --quick      # small tables and batch: a smoke run
    python3 benchmarks/train_dlrm.py --full       # configs/dlrm_criteo.py's 26 x 1M x 64
    python3 benchmarks/train_dlrm.py --json run.json  # also the run's record (timing.Run)
    bash benchmarks/install_peers.sh              # first, for the TorchRec columns

The Criteo-like DLRM of issue 6: 13 dense features, 26 single-hot tables of
643,601 rows in all (``TABLE_SIZES``), width 64, bottom MLP 13-512-256-64,
dot interaction, top MLP 512-256-1, batch 2048, binary cross-entropy;
row-wise AdaGrad on the tables (lr 0.05, eps 1e-8, accumulators from 0, as
FBGEMM) and Adagrad on the MLPs (lr 0.01). The same synthetic batches
(embedlib's planted ``SyntheticSource``, Zipf(1.05) ids) are generated once,
saved to an ``.npz`` and fed to every side, cycling through them.

Each variant runs in its own long-lived worker process (its own peak RSS,
its own device count), built and warmed up (compiled) before any timing; the
benchmark then asks each worker in turn for ``--steps`` steps, for
``--repeats`` rounds, so machine noise hits every side alike. Reported:
examples/s min / median / max over the rounds, the worker's peak RSS, and
the ratio of medians to TorchRec fused, and each variant's loss after the
timed steps (the mean over its last round's steps: every variant has then
trained on the same batches in the same order), beside embedlib's. Variants
with the same parameters and rules (TorchRec fused, embedlib on 8 devices)
should agree with embedlib's loss up to their different initial values;
the frozen-table variants should be higher. Variants:

- ``embedlib, 1 device``: ``embedlib.training.train_lib.train_step`` (jitted, state
  donated) on ``embedlib.training.setup.model_and_optimizer`` for this model, called
  through ``nnx.cached_partial`` as ``train_and_evaluate`` calls it (every
  JAX variant is), i.e.
  ``embedlib.models.DLRM`` on an ``EmbeddingCollection``,
  ``optim.value_and_grad`` + ``SparseAwareOptimizer(optax.adagrad,
  RowWiseAdagrad)``; ``XLA_FLAGS`` forces one CPU device.
- ``embedlib, 8 simulated devices``: the same on 8 simulated CPU devices
  sharing the 2 cores (tables planned by the collection; shows the cost of
  the collectives, not a speed-up). ``--no-8dev`` skips it.
- ``JAX dense``: 26 ``nnx.Embed`` + ``nnx.Optimizer(optax.adagrad)`` (a
  table-sized gradient and update per table): the tables at the sparse
  side's lr 0.05 with accumulators from 0 and eps 1e-8 (element-wise, not
  row-wise, AdaGrad), the MLPs as embedlib's. With optax's defaults
  (accumulators from 0.1) a table entry's step is ``lr * g / sqrt(0.1 +
  g**2)``, about ``3 * lr * g`` for a row's small gradient (a mean over the
  batch), where row-wise AdaGrad's first step is ``lr`` whatever ``g``: the
  tables barely moved, and this variant's loss was the frozen-table
  variant's (0.545 both).
- ``JAX frozen tables``: the embedlib model with only the MLPs trained
  (lookups still run forward): the ceiling for JAX here.
- ``TorchRec fused``: ``FusedEmbeddingBagCollection`` + FBGEMM
  ``EXACT_ROWWISE_ADAGRAD`` (``benchmarks/peers/torchrec_dlrm.py``).
- ``PyTorch frozen tables``: TorchRec's ``EmbeddingBagCollection`` frozen.

The PyTorch workers run with ``--torch-threads`` threads (default 2, the
machine's cores) and ``OMP_WAIT_POLICY=PASSIVE`` (PEERS.md: it steadies
2-thread timings; it also keeps an idle worker from spinning while another
one is timed). ``--keep-freed-malloc`` runs every worker, JAX and PyTorch
alike, with glibc's mmap and trim thresholds raised (``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` at 2^31 - 1), so a step's freed temporaries
are reused by the next instead of faulting in fresh pages. Without it, the
embedlib and JAX frozen workers still raise them for themselves, as
``train_and_evaluate`` does (``embedlib.host_memory``), and every other worker
runs with glibc's defaults, as its users run it.
``--full`` takes ``configs/dlrm_criteo.py``'s tables instead, 26 of
1,000,000 rows (6.2 GiB of f32), and times embedlib on one device beside
TorchRec fused only, interleaved like the other sizes: the two workers hold
about 7.5 GiB each, which a 24 GB machine holds when nothing else runs. When
the memory available (``/proc/meminfo``) is short of ``FULL_WORKER_GIB`` a
worker, or with ``--one-at-a-time``, they run one after the other (built,
warmed up, timed for every round, closed, then the next) and the record notes
that the sides did not share the machine's noise. The dense JAX variant (a
table-sized gradient and Adagrad slot) would not fit at all.
Without ``.peers/`` the peer columns are skipped with a note. The named
ratios (``record_ratios``: ``vs_torchrec_fused`` and others) are printed
beside the machine's state and kept in ``--json``'s record
(``benchmarks/timing.py``). Never asserts a time.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(1, ROOT)
sys.path.insert(2, HERE)

import timing  # noqa: E402
from worker_protocol import Worker, WorkerError, default_env, peer_env, serve  # noqa: E402

#: Criteo Kaggle (display advertising challenge) cardinalities of C1..C26,
#: each capped at 74,525 rows (the hashing trick, like DLRM's
#: --max-ind-range), with the 3 rows left over added to C3 so the 26 tables
#: hold exactly 643,601 rows (157 MiB of f32 at width 64). The skew of the
#: original survives: 8 tables at the cap hold 93% of the rows, 7 have
#: fewer than 30.
#: Rows of each table at ``--full``: configs/dlrm_criteo.py's ``table_sizes``.
FULL_ROWS = 1_000_000
TABLE_SIZES = (
    1460, 583, 74528, 74525, 305, 24, 12517, 633, 3, 74525, 5683, 74525, 3194,
    27, 14992, 74525, 10, 5652, 2173, 4, 74525, 18, 15, 74525, 105, 74525,
)
NUM_DENSE = 13
DIM = 64
BOTTOM = (512, 256)          # + DIM
TOP = (512, 256, 1)
BATCH = 2048
DENSE_LR = 0.01
SPARSE_LR = 0.05
ZIPF = 1.05

PEER_PYTHON = os.path.join(ROOT, ".peers", "bin", "python")
TORCH_SCRIPT = os.path.join(HERE, "peers", "torchrec_dlrm.py")
EMBEDLIB = "embedlib, 1 device"
TORCHREC = "TorchRec fused"
JAX_DENSE = "JAX dense: nnx.Embed + optax.adagrad"
JAX_FROZEN = "JAX frozen tables (MLPs only)"


# -- the data -------------------------------------------------------------


def make_batches(path, sizes, batch_size, num_batches, seed=0):
  """Saves ``num_batches`` planted synthetic batches to ``path`` (.npz).

  Returns:
    Distinct ids per batch (mean over batches), for the header.
  """
  from embedlib import data as data_lib  # pylint: disable=g-import-not-at-top

  spec = data_lib.DataSpec.from_sizes(NUM_DENSE, list(sizes))
  source = data_lib.SyntheticSource(spec, batch_size=batch_size, seed=seed,
                                    zipf_exponent=ZIPF)
  batches = [source.batch(i) for i in range(num_batches)]
  names = spec.feature_names
  dense = np.stack([b["dense"] for b in batches]).astype(np.float32)
  sparse = np.stack([np.stack([b["sparse"][n] for n in names], -1) for b in batches])
  label = np.stack([b["label"] for b in batches]).astype(np.float32)
  np.savez(path, dense=dense, sparse=sparse.astype(np.int32), label=label)
  distinct = [sum(len(np.unique(s[:, f])) for f in range(len(sizes))) for s in sparse]
  return float(np.mean(distinct))


# -- JAX workers (``--worker``) ----------------------------------------------


def _config(sizes, batch_size):
  from configs import dlrm_criteo  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top

  config = dlrm_criteo.get_config()
  config.data.source = "synthetic"
  config.data.table_sizes = tuple(sizes)
  config.data.zipf_exponent = ZIPF
  config.model.embed_dim = DIM
  config.model.bottom_sizes = BOTTOM
  config.model.top_sizes = TOP
  config.optim.dense = ml_collections.ConfigDict(dict(
      name="adagrad", learning_rate=DENSE_LR, schedule="constant", warmup_steps=0))
  config.optim.sparse = ml_collections.ConfigDict(dict(
      name="rowwise_adagrad", learning_rate=SPARSE_LR, schedule="constant", warmup_steps=0))
  config.batch_size = batch_size
  return config


def _embedlib_step(kind, sizes, batch_size):
  """(step(batch) -> loss, mesh) for the embedlib model: sparse or frozen tables."""
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from embedlib import optim  # pylint: disable=g-import-not-at-top
  from embedlib.training import setup, train_lib  # pylint: disable=g-import-not-at-top

  config = _config(sizes, batch_size)
  mesh = setup.make_mesh(config)
  task = setup.task(config)
  model, optimizer = setup.model_and_optimizer(config, task, task.data_spec(), mesh)
  if kind == "embedlib":
    # As train_lib.train_and_evaluate calls it: cached_partial flattens the
    # model and optimizer once, not on every call, so the timed step holds no
    # Python flattening.
    step = nnx.cached_partial(train_lib.train_step, model, optimizer)
    return (lambda batch: step(batch, task=task)), mesh
  del optimizer
  keys = frozenset(k for k, _ in optim.sparse_tables(model))
  dense = nnx.All(nnx.Param, optim.NotTables(keys))
  opt = nnx.Optimizer(model, optax.adagrad(DENSE_LR), wrt=dense)

  @nnx.jit(donate_argnums=(0, 1))
  def frozen_step(model, opt, batch):
    loss, grads = nnx.value_and_grad(train_lib.loss_fn, argnums=nnx.DiffState(0, dense))(model, batch)
    opt.update(model, grads)
    return loss

  return nnx.cached_partial(frozen_step, model, opt), mesh


def _dense_step(sizes):
  """26 ``nnx.Embed`` and ``optax.adagrad`` on every parameter."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from embedlib.models.blocks import MLP, dot_interaction  # pylint: disable=g-import-not-at-top
  from embedlib.training import train_lib  # pylint: disable=g-import-not-at-top

  class DenseDLRM(nnx.Module):

    def __init__(self, rngs):
      self.bottom = MLP(NUM_DENSE, BOTTOM + (DIM,), final_activation=True, rngs=rngs)
      self.tables = nnx.List([nnx.Embed(n, DIM, rngs=rngs) for n in sizes])
      n = len(sizes) + 1
      self.top = MLP(DIM + n * (n - 1) // 2, TOP, rngs=rngs)

    def __call__(self, dense, sparse):
      x = self.bottom(dense)
      vectors = [t(sparse[f"f{i}"]) for i, t in enumerate(self.tables)]
      z = jnp.concatenate([x, dot_interaction([x] + vectors)], axis=1)
      return self.top(z)[:, 0]

  model = DenseDLRM(nnx.Rngs(0))
  # The tables at the sparse side's learning rate and its accumulators
  # (from 0, eps 1e-8, as RowWiseAdagrad and FBGEMM): optax's defaults
  # (accumulators from 0.1) shrink a table's steps by sqrt(0.1 / g**2), and
  # its tables barely moved from their initial values (the module docstring).
  # The MLPs as the embedlib model's (the config's optax.adagrad).
  tables = nnx.All(nnx.Param, nnx.PathContains("tables"))
  mlps = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("tables")))
  table_opt = nnx.Optimizer(
      model, optax.adagrad(SPARSE_LR, initial_accumulator_value=0.0, eps=1e-8), wrt=tables)
  mlp_opt = nnx.Optimizer(model, optax.adagrad(DENSE_LR), wrt=mlps)

  @nnx.jit(donate_argnums=(0, 1, 2))
  def step(model, table_opt, mlp_opt, batch):
    loss, grads = nnx.value_and_grad(train_lib.loss_fn)(model, batch)
    table_opt.update(model, nnx.filter_state(grads, tables))
    mlp_opt.update(model, nnx.filter_state(grads, mlps))
    return loss

  return nnx.cached_partial(step, model, table_opt, mlp_opt)


def jax_worker(args):
  """Builds one JAX variant, warms it up, then serves ``run`` requests."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from embedlib import host_memory  # pylint: disable=g-import-not-at-top
  from embedlib import data as data_lib  # pylint: disable=g-import-not-at-top

  sizes = [int(x) for x in args.tables.split(",")]
  raw = np.load(args.data)
  names = [f"f{i}" for i in range(len(sizes))]
  host = [{"dense": d, "sparse": {n: s[:, i] for i, n in enumerate(names)}, "label": y}
          for d, s, y in zip(raw["dense"], raw["sparse"], raw["label"])]
  batch_size = host[0]["label"].shape[0]
  if args.worker == "dense":
    step = _dense_step(sizes)
    batches = [jax.device_put(b) for b in host]
  else:
    # As train_and_evaluate does before it builds anything: freed blocks kept
    # for the next step (embedlib.host_memory; the frozen ceiling alike).
    host_memory.keep_freed_blocks()
    step, mesh = _embedlib_step(args.worker, sizes, batch_size)
    batches = [data_lib.to_global_batch(b, mesh) for b in host]
  position = [0]

  def run_steps(n):
    """The mean loss of the ``n`` steps: one step's is noisy, a round cycles the batches."""
    losses = []
    for _ in range(n):
      losses.append(step(batches[position[0] % len(batches)]))
      position[0] += 1
    return float(jax.block_until_ready(jnp.mean(jnp.stack(losses))))

  start = time.perf_counter()
  first = run_steps(args.warmup)
  serve(run_steps, {"jax": jax.__version__, "devices": jax.device_count(),
                    "first_loss": first, "warmup_s": time.perf_counter() - start})


# -- the benchmark ------------------------------------------------------------


def _xla_flags(devices):
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", "")).strip()
  return f"{flags} --xla_force_host_platform_device_count={devices}".strip()


#: glibc's mmap and trim thresholds, as environment variables: freed blocks
#: stay in the heap for the next step instead of going back to the system.
KEEP_FREED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "2147483647",
                     "MALLOC_TRIM_THRESHOLD_": "2147483647"}


def _workers(args, data, sizes):
  """name -> (argv, env) of every variant this run times."""
  tables = ",".join(map(str, sizes))
  common = ["--data", data, "--tables", tables, "--warmup", str(args.warmup)]
  me = [sys.executable, os.path.abspath(__file__)]
  # Every worker, JAX and PyTorch alike, gets the same malloc settings.
  malloc = KEEP_FREED_MALLOC if args.keep_freed else {}
  env = lambda **kw: default_env(**malloc, **kw)  # noqa: E731
  jax_env = lambda n: env(JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(n))
  out = {EMBEDLIB: (me + ["--worker", "embedlib"] + common, jax_env(1))}
  if args.eight_devices and not args.full:
    out["embedlib, 8 simulated devices"] = (me + ["--worker", "embedlib"] + common, jax_env(8))
  if not args.full:
    out[JAX_DENSE] = (me + ["--worker", "dense"] + common, jax_env(1))
    out[JAX_FROZEN] = (me + ["--worker", "frozen"] + common, jax_env(1))
  if os.path.exists(args.peer_python):
    torch_env = peer_env(**malloc, OMP_WAIT_POLICY="PASSIVE")
    torch = [args.peer_python, TORCH_SCRIPT, "--threads", str(args.torch_threads),
             "--dim", str(DIM), "--num-dense", str(NUM_DENSE),
             "--bottom", ",".join(map(str, BOTTOM)), "--top", ",".join(map(str, TOP)),
             "--dense-lr", str(DENSE_LR), "--sparse-lr", str(SPARSE_LR)] + common
    out[TORCHREC] = (torch + ["--variant", "fused"], torch_env)
    if not args.full:
      out["PyTorch frozen tables (MLPs only)"] = (torch + ["--variant", "frozen"], torch_env)
  return out


#: Memory one ``--full`` worker holds at its peak (tables, slots, a step's
#: temporaries), with room for the page cache the batches file needs.
FULL_WORKER_GIB = 8.0


def _available_gib() -> float:
  return timing.available_memory_bytes() / 2**30


def _start(specs):
  """Starts every worker, then waits for each to be built and warmed up."""
  workers, info = {}, {}
  try:
    for name, (argv, env) in specs.items():
      workers[name] = Worker(name, argv, env)
    for name, w in workers.items():
      info[name] = w.ready()
  except WorkerError:
    for w in workers.values():
      w.kill()
    raise
  return workers, info


def _print_results(rates, rss, losses, batch, rounds="interleaved rounds"):
  base = statistics.median(rates[TORCHREC]) if TORCHREC in rates else None
  ref = "TorchRec fused" if base else EMBEDLIB
  base = base or statistics.median(rates[EMBEDLIB])
  print(f"\nexamples/s over {len(next(iter(rates.values())))} {rounds} "
        f"(batch {batch}); ratio = median / median of {ref}; loss = mean over the last "
        "round's steps (every variant trains on the same batches in the same order)")
  print(f"{'variant':40s} {'min':>8s} {'median':>8s} {'max':>8s} {'ratio':>6s} "
        f"{'ms/step':>8s} {'peak RSS MiB':>13s} {'loss':>7s}")
  for name, r in rates.items():
    med = statistics.median(r)
    print(f"{name:40s} {min(r):8.0f} {med:8.0f} {max(r):8.0f} {med / base:6.2f} "
          f"{batch / med * 1e3:8.1f} {rss[name]:13.0f} {losses[name]:7.4f}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small tables, batch 256: a smoke run")
  parser.add_argument("--full", action="store_true",
                      help="26 tables of 1M rows, embedlib beside TorchRec fused")
  parser.add_argument("--one-at-a-time", action="store_true",
                      help="at --full, time one worker after the other (less memory, "
                           "not interleaved)")
  parser.add_argument("--repeats", type=int, default=None,
                      help="interleaved rounds (default 7)")
  parser.add_argument("--steps", type=int, default=None,
                      help="steps per round and variant (default 16)")
  parser.add_argument("--warmup", type=int, default=3,
                      help="untimed steps (compilation) per worker")
  parser.add_argument("--no-8dev", dest="eight_devices", action="store_false",
                      help="skip the 8-simulated-device embedlib column")
  parser.add_argument("--torch-threads", type=int, default=2)
  parser.add_argument("--keep-freed-malloc", dest="keep_freed", action="store_true",
                      help="raise glibc's mmap and trim thresholds in every worker")
  parser.add_argument("--peer-python", default=PEER_PYTHON,
                      help="python of the peer venv (default .peers/bin/python)")
  parser.add_argument("--worker", choices=("embedlib", "frozen", "dense"), help=argparse.SUPPRESS)
  parser.add_argument("--data", help=argparse.SUPPRESS)
  parser.add_argument("--tables", help=argparse.SUPPRESS)
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  if args.worker:
    jax_worker(args)
    return
  record = timing.Run("train_dlrm", argv, smoke=args.quick)

  sizes = [max(2, n // 100) for n in TABLE_SIZES] if args.quick else list(TABLE_SIZES)
  if args.full:
    sizes = [FULL_ROWS] * len(TABLE_SIZES)
  batch = 256 if args.quick else BATCH
  repeats = args.repeats or (2 if args.quick else 7)
  steps = args.steps or (3 if args.quick else 16)
  with tempfile.TemporaryDirectory(prefix="train_dlrm_") as tmp:
    run(args, sizes, batch, repeats, steps, os.path.join(tmp, "batches.npz"), record)
  record.finish(args.json)


def record_ratios(record, rates) -> None:
  """The named ratios, by median examples/s: ``vs_torchrec_fused`` (embedlib's
  over TorchRec fused's, i.e. TorchRec's step time over ours), ``vs_jax_dense``
  (over the dense JAX variant's) and ``share_of_frozen`` (embedlib's over the
  frozen-table JAX ceiling's)."""
  for name, other in (("vs_torchrec_fused", TORCHREC), ("vs_jax_dense", JAX_DENSE)):
    if other in rates:
      record.ratio(name, timing.median_ratio(rates[EMBEDLIB], rates[other]))
  if JAX_FROZEN in rates:
    record.ratio("share_of_frozen", timing.median_ratio(rates[EMBEDLIB], rates[JAX_FROZEN]))


def run(args, sizes, batch, repeats, steps, data, record):
  num_batches = min(steps, 16)
  distinct = make_batches(data, sizes, batch, num_batches)
  print(f"DLRM: {NUM_DENSE} dense, {len(sizes)} tables of {sum(sizes):,} rows x {DIM} "
        f"(f32 {sum(sizes) * DIM * 4 / 2**20:.0f} MiB), bottom {NUM_DENSE}-"
        f"{'-'.join(map(str, BOTTOM + (DIM,)))}, dot, top {'-'.join(map(str, TOP))}, "
        f"batch {batch}; {num_batches} synthetic batches (Zipf {ZIPF}), "
        f"{distinct:,.0f} distinct ids per batch of {batch * len(sizes):,}")
  print(f"rows: {','.join(map(str, sizes))}")
  malloc = " ".join(f"{k}={v}" for k, v in KEEP_FREED_MALLOC.items())
  print(f"every worker: {malloc}" if args.keep_freed else "every worker: glibc's default malloc")
  specs = _workers(args, data, sizes)
  if TORCHREC not in specs:
    print(f"TorchRec columns skipped: {args.peer_python} not found; install the peers "
          "with `bash benchmarks/install_peers.sh` (the recipe of ../shared/PEERS.md).")
    record.note("no TorchRec columns (.peers/ not installed), so no vs_torchrec_fused")
  one_at_a_time = args.full and args.one_at_a_time
  if args.full and not one_at_a_time:
    need, have = FULL_WORKER_GIB * len(specs), _available_gib()
    if have < need:
      print(f"--full: {have:.1f} GiB available, {need:.0f} GiB needed to run the "
            f"{len(specs)} workers side by side: timing them one at a time instead")
      one_at_a_time = True
  if one_at_a_time:
    record.note("--full: one worker at a time, not interleaved: the sides did not share "
                "the machine's noise")
  rates, rss, losses = {}, {}, {}
  groups = [{n: spec} for n, spec in specs.items()] if one_at_a_time else [specs]
  for group in groups:
    r, m, l = _time_workers(group, repeats, steps, batch, record.probe)
    rates.update(r), rss.update(m), losses.update(l)
  _print_results(rates, rss, losses, batch,
                 "rounds, one worker at a time" if one_at_a_time else "interleaved rounds")
  _print_agreement(losses)
  record.add_times(rates, unit="examples/s")
  record_ratios(record, rates)
  if TORCHREC in rates:
    ratio = statistics.median(rates[EMBEDLIB]) / statistics.median(rates[TORCHREC])
    print(f"embedlib / TorchRec fused (medians): {ratio:.2f}x  (target at --full: >= 1.8x)")
  else:
    print("TorchRec columns skipped (no .peers/): run `bash benchmarks/install_peers.sh`.")

#: Variants that train the same parameters with the same rules (row-wise
#: AdaGrad on the tables, Adagrad on the MLPs), from different initial
#: values (each library's initialisers), against embedlib on one device.
SAME_TRAINING = (TORCHREC, "embedlib, 8 simulated devices")


def _print_agreement(losses):
  """Each variant's loss beside embedlib's: what the same training should match."""
  if EMBEDLIB not in losses:
    return
  ours = losses[EMBEDLIB]
  for name, loss in losses.items():
    if name == EMBEDLIB:
      continue
    what = ("the same rules: should agree" if name in SAME_TRAINING else
            "tables frozen: higher where the tables learn" if "frozen" in name else
            "element-wise Adagrad on the tables")
    print(f"  loss {name}: {loss:.4f}, embedlib {ours:.4f}, difference {loss - ours:+.4f} "
          f"({what})")


def _time_workers(specs, repeats, steps, batch, between_rounds=None):
  """Builds ``specs``' workers, times them in shuffled rounds; ``(rates, rss, losses)``.

  ``between_rounds`` is called after every round (the run's copy probe).
  """
  start = time.perf_counter()
  workers, info = _start(specs)
  for name, i in info.items():
    detail = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) and "rss" not in k
                       else f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}"
                       for k, v in i.items())
    print(f"  ready: {name}: {detail}")
  print(f"built and warmed up in {time.perf_counter() - start:.0f} s; timing "
        f"{repeats} rounds x {steps} steps per variant")
  rates = {name: [] for name in workers}
  losses = {}
  try:
    names = list(workers)
    rng = random.Random(0)
    for _ in range(repeats):
      # A seeded shuffle each round: a rotation would keep every variant
      # behind the same predecessor, whose after-effects skew its timings.
      order = names[:]
      rng.shuffle(order)
      for name in order:
        out = workers[name].run(steps)
        rates[name].append(steps * batch / out["seconds"])
        losses[name] = out["loss"]
      if between_rounds is not None:
        between_rounds()
    rss = {name: w.close()["peak_rss_mib"] for name, w in workers.items()}
  finally:
    for w in workers.values():
      w.kill()
  return rates, rss, losses


if __name__ == "__main__":
  main()
