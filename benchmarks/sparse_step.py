"""Sparse row-wise AdaGrad train step against the dense optax step, in one run.

    python3 benchmarks/sparse_step.py            # 1M x 64 and 10M x 32 f32, 65,536 Zipf ids
    python3 benchmarks/sparse_step.py --quick    # small sizes, a smoke run

One device, one ``ShardedEmbed`` (no mesh), ids drawn from Zipf(1.05) and
hashed over the table. Each step is the whole train step, jitted with the
state donated: lookup, gradient, update.

- sparse: ``embedlib.optim.value_and_grad`` + ``SparseAwareOptimizer`` with
  ``RowWiseAdagrad`` (row gradients, dedup, update of the touched rows);
- dense: ``nnx.value_and_grad`` + ``nnx.Optimizer(optax.adagrad)`` (a
  table-sized gradient, every row updated).

Prints min / median / max ms over interleaved repeats, the ratio of medians
(dense / sparse: how many times faster the sparse step is; target >= 10),
and each compiled step's temporary bytes from XLA's memory analysis beside
the table's and the looked-up rows' bytes (target: no table-sized
temporary). Peak RSS is printed after each table for reference (it is the
process's high-water mark, so it includes the dense step's). Never asserts
a time.
"""

import argparse
import os
import resource
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import embedlib  # noqa: E402
from embedlib import optim  # noqa: E402
from timing import interleaved, print_table  # noqa: E402

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
  """Calls a donating step, keeping the returned state for the next call."""

  def __init__(self, step, state):
    self.step, self.state = step, state

  def __call__(self, ids):
    loss, self.state = self.step(self.state, ids)
    return loss


def peak_rss_mib():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(vocab, width, n, repeats):
  ids = zipf_ids(n, vocab)
  table_bytes = vocab * width * 4
  rows_bytes = n * width * 4
  cases, temps = {}, {}
  for name, sparse in (("sparse row-wise AdaGrad", True), ("dense nnx.Optimizer(adagrad)", False)):
    step, state = build_step(vocab, width, sparse)
    temps[name] = step.lower(state, ids).compile().memory_analysis().temp_size_in_bytes
    cases[name] = (Stepper(step, state), (ids,))
  uniq = len(np.unique(np.asarray(ids)))
  times = interleaved(cases, repeats)
  title = (f"train step: {vocab:,} x {width} f32 table, {n:,} Zipf(1.05) ids "
           f"({uniq:,} distinct), ms")
  print_table(times, "sparse row-wise AdaGrad", title)
  sparse_ms, dense_ms = (statistics.median(t) for t in times.values())
  print(f"speed-up (dense median / sparse median): {dense_ms / sparse_ms:.1f}x  (target >= 10x)")
  print(f"table {table_bytes / MiB:.1f} MiB, looked-up rows {rows_bytes / MiB:.1f} MiB")
  for name, temp in temps.items():
    print(f"  compiled temp bytes, {name:30s} {temp / MiB:9.1f} MiB "
          f"({temp / rows_bytes:.2f}x rows, {temp / table_bytes:.3f}x table)")
  print(f"peak RSS so far: {peak_rss_mib():.0f} MiB")
  for stepper, _ in cases.values():
    del stepper.state


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
  parser.add_argument("--repeats", type=int, default=None)
  args = parser.parse_args()
  sizes = [(100_000, 64), (1_000_000, 32)] if args.quick else [(1_000_000, 64), (10_000_000, 32)]
  n = 8192 if args.quick else 65_536
  repeats = args.repeats or (3 if args.quick else 10)
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} device(s)")
  for vocab, width in sizes:
    run(vocab, width, n, repeats)


if __name__ == "__main__":
  main()
