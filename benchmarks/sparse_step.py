"""Sparse row-wise AdaGrad train step against the dense optax step, in one run.

    python3 benchmarks/sparse_step.py            # 1M x 64 and 10M x 32 f32, 65,536 Zipf ids
    python3 benchmarks/sparse_step.py --quick    # small sizes, a smoke run
    bash benchmarks/install_peers.sh             # first, for the PyTorch columns

One device, one ``ShardedEmbed`` (no mesh), ids drawn from Zipf(1.05) and
hashed over the table. Each step is the whole train step, jitted with the
state donated: lookup, gradient, update, loss ``mean(sum(rows, -1) ** 2)``.

- sparse: ``embedlib.optim.value_and_grad`` + ``SparseAwareOptimizer`` with
  ``RowWiseAdagrad`` (row gradients, dedup, update of the touched rows);
- dense: ``nnx.value_and_grad`` + ``nnx.Optimizer(optax.adagrad)`` (a
  table-sized gradient, every row updated);
- PyTorch columns, for scale, when ``.peers/`` is installed (each in its own
  worker, ``benchmarks/peers/torch_sparse_step.py``, same ids and loss):
  FBGEMM's fused row-wise AdaGrad (TorchRec ``FusedEmbeddingBagCollection``),
  ``nn.Embedding(sparse=True)`` + ``torch.optim.Adagrad``, and the dense
  ``nn.Embedding`` + ``Adagrad``. ``--no-peers`` leaves them out.

Timing: in each round the cases run in a shuffled order, and each runs one
untimed step before its timed one. The untimed step matters: a step leaves
work behind it (the dense step frees a quarter GiB of temporaries after its
results are ready), and without it the first sparse step after a dense one
read about 13 ms slower here, a cost that vanished with a 50 ms pause in
between (2026-11-30). A JAX step is timed until its loss and whole new state
are ready.

Prints min / median / max ms per case and its ratio to the sparse step, the
speed-up (dense median / sparse median; target >= 10), each compiled JAX
step's temporary bytes from XLA's memory analysis beside the table's and
the looked-up rows' bytes (target: no table-sized temporary), its peak
(arguments + outputs that reuse no donated input + temporaries), and the
minor page faults per timed JAX step: XLA:CPU allocates a step's
temporaries afresh each step, and glibc serves allocations over its mmap
threshold (at most 32 MiB, and anything over 64 MiB from a thread) with
fresh pages, each first touch a fault (``train/host_memory.py``). Peak RSS
is printed after each table (the process's high-water mark, so it includes
the dense step's). Never asserts a time.
"""

import argparse
import os
import random
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(2, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import embedlib  # noqa: E402
from embedlib import optim  # noqa: E402
from timing import print_table  # noqa: E402
from worker_protocol import default_env, missing_note, peak_rss_mib, start_or_note  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_PYTHON = os.path.join(os.path.dirname(HERE), ".peers", "bin", "python")
TORCH_SCRIPT = os.path.join(HERE, "peers", "torch_sparse_step.py")
PEERS = {  # column -> worker --variant
    "PyTorch FBGEMM fused row-wise AdaGrad": "fused",
    "PyTorch Embedding(sparse=True) + Adagrad": "sparse",
    "PyTorch dense Embedding + Adagrad": "dense",
}
SPARSE, DENSE = "sparse row-wise AdaGrad", "dense nnx.Optimizer(adagrad)"
MiB = 1 << 20
LR = 0.01


def zipf_ids(n, vocab, seed=0):
  """Zipf(1.05) ranks, hashed so the hot rows are spread over the table."""
  rng = np.random.default_rng(seed)
  ranks = rng.zipf(1.05, n).astype(np.uint64)
  return jnp.asarray((ranks * np.uint64(2654435761)) % np.uint64(vocab), jnp.int32)


class Model(nnx.Module):

  def __init__(self, vocab, width, rngs):
    self.emb = embedlib.ShardedEmbed(vocab, width, rngs=rngs)

  def __call__(self, ids):
    return jnp.mean(jnp.sum(self.emb(ids), axis=-1) ** 2)


def build_step(vocab, width, sparse):
  """A jitted ``step(state, ids) -> (loss, state)`` with the state donated."""
  model = Model(vocab, width, nnx.Rngs(0))
  if sparse:
    opt = optim.SparseAwareOptimizer(model, None, optim.RowWiseAdagrad(LR))
  else:
    opt = nnx.Optimizer(model, optax.adagrad(LR), wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))
  grad = optim.value_and_grad if sparse else nnx.value_and_grad

  def step(state, ids):
    model, opt = nnx.merge(graphdef, state)
    loss, grads = grad(lambda m: m(ids))(model)
    opt.update(model, grads)
    return loss, nnx.state((model, opt))

  return jax.jit(step, donate_argnums=0), state


class Stepper:
  """Calls a donating step, keeping the returned state for the next call.

  ``timed()`` runs one step and returns its milliseconds, until the loss and
  the whole new state are ready, and records its minor page faults.
  """

  def __init__(self, step, state):
    self.step, self.state = step, state
    self.faults = []

  def __call__(self, ids):
    loss, self.state = self.step(self.state, ids)
    return loss

  def timed(self, ids):
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    jax.block_until_ready((self(ids), self.state))
    ms = (time.perf_counter() - start) * 1e3
    self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    return ms


def settled_rounds(runs, repeats, seed=0):
  """Times every case once per round, shuffled, each after one untimed call.

  Args:
    runs: name -> ``run()``, which performs one step and returns its ms.
    repeats: rounds.

  Returns:
    name -> list of milliseconds.
  """
  times = {name: [] for name in runs}
  rng = random.Random(seed)
  for _ in range(repeats):
    order = list(runs)
    rng.shuffle(order)
    for name in order:
      runs[name]()   # untimed: absorbs what the previous case left behind
      times[name].append(runs[name]())
  return times


def start_peers(args, tmp, ids, vocab, width):
  """Starts the PyTorch workers; returns ``(workers, notes)``."""
  if not args.peers:
    return {}, []
  missing = missing_note(args.peer_python)
  if missing:
    return {}, [missing]
  data = os.path.join(tmp, "ids.npz")
  np.savez(data, ids=np.asarray(ids))
  env = default_env(OMP_WAIT_POLICY="PASSIVE")
  workers, notes = {}, []
  for col, variant in PEERS.items():
    w, info = start_or_note(
        col, [args.peer_python, TORCH_SCRIPT, "--data", data, "--rows", str(vocab),
              "--width", str(width), "--variant", variant,
              "--threads", str(args.torch_threads)], env, notes)
    if w is None:
      continue
    print(f"  {col}: " + ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items()))
    workers[col] = w
  return workers, notes


def run(vocab, width, n, repeats, args):
  ids = zipf_ids(n, vocab)
  table_bytes = vocab * width * 4
  rows_bytes = n * width * 4
  steppers, memory = {}, {}
  for name, sparse in ((SPARSE, True), (DENSE, False)):
    step, state = build_step(vocab, width, sparse)
    memory[name] = step.lower(state, ids).compile().memory_analysis()
    steppers[name] = Stepper(step, state)
    jax.block_until_ready(steppers[name](ids))   # compile and warm up
  uniq = len(np.unique(np.asarray(ids)))
  print(f"\n{vocab:,} x {width} f32 table, {n:,} Zipf(1.05) ids ({uniq:,} distinct)")
  runs = {name: (lambda s=s: s.timed(ids)) for name, s in steppers.items()}
  with tempfile.TemporaryDirectory() as tmp:
    workers, notes = start_peers(args, tmp, ids, vocab, width)
    try:
      for col, w in workers.items():
        runs[col] = lambda w=w: w.run(1)["seconds"] * 1e3
      times = settled_rounds(runs, repeats)
    finally:
      for w in workers.values():
        w.close()
  print_table(times, SPARSE, f"train step, ms ({repeats} rounds)")
  for note in notes:
    print(note)
  sparse_ms, dense_ms = statistics.median(times[SPARSE]), statistics.median(times[DENSE])
  print(f"speed-up (dense median / sparse median): {dense_ms / sparse_ms:.1f}x  (target >= 10x)")
  print(f"table {table_bytes / MiB:.1f} MiB, looked-up rows {rows_bytes / MiB:.1f} MiB")
  for name, mem in memory.items():
    temp = mem.temp_size_in_bytes
    # Live at the step's peak: inputs, temporaries, and outputs that do not
    # reuse a donated input.
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + temp
    print(f"  {name:30s} compiled temp bytes {temp / MiB:7.1f} MiB "
          f"({temp / rows_bytes:.2f}x rows, {temp / table_bytes:.3f}x table), step peak "
          f"{peak / MiB:7.1f} MiB; minor page faults per step "
          f"{statistics.median(steppers[name].faults):,.0f}")
  print(f"peak RSS so far: {peak_rss_mib():.0f} MiB")
  for stepper in steppers.values():
    del stepper.state


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
  parser.add_argument("--repeats", type=int, default=None, help="timed rounds")
  parser.add_argument("--no-peers", dest="peers", action="store_false",
                      help="leave out the PyTorch columns")
  parser.add_argument("--torch-threads", type=int, default=2)
  parser.add_argument("--peer-python", default=PEER_PYTHON,
                      help="python of the peer venv (default .peers/bin/python)")
  args = parser.parse_args()
  sizes = [(100_000, 64), (1_000_000, 32)] if args.quick else [(1_000_000, 64), (10_000_000, 32)]
  n = 8192 if args.quick else 65_536
  repeats = args.repeats or (3 if args.quick else 10)
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} device(s)")
  for vocab, width in sizes:
    run(vocab, width, n, repeats, args)


if __name__ == "__main__":
  main()
