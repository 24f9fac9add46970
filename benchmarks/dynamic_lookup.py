"""A dynamic table's train step against a fixed table's, in one run.

    python3 benchmarks/dynamic_lookup.py           # 1M x 64 f32, 65,536 Zipf ids
    python3 benchmarks/dynamic_lookup.py --quick   # 65,536 x 16, 4,096 ids (--smoke: the same)
    python3 benchmarks/dynamic_lookup.py --zeros-init  # the dynamic rows start at zero: no draws

One device of jax's default backend, no mesh. Ids are Zipf(1.05) ranks
spread over 64-bit values (raw ids); the fixed table takes them hashed mod
its rows, as ``embedlib.data.criteo`` does today. Each case is the whole
train step, jitted with its state donated: lookup, gradient of
``mean(sum(rows, -1) ** 2)``, row-wise AdaGrad update of the touched rows.

- fixed: ``ShardedEmbed(rows, width)`` with the hashed ids;
- dynamic: ``DynamicEmbed(rows, width)`` (LRU, buckets of 128, admitted on
  first sight) with the raw ids as words: the map's step (sort, bucket
  scan, placement, resets of placed rows and their slots) comes on top;
- dynamic, eval: the dynamic table's lookup alone in ``eval()`` mode, beside
  a fixed lookup alone (the map read without its update).

The dynamic table is warmed with a few steps first, so the timed steps
admit and evict as a running job's do; after them its map must equal
``embedlib.dynamic.reference`` run on the same batches (every resident id
and its row), or the script exits 1 before timing anything. Prints min / median / max ms and
the ratio to the fixed step (the issue's target: at most 1.5 on CPU), the
map's bytes per row, and the last step's statistics. Never asserts a time.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import embedlib  # noqa: E402
from embedlib import dynamic, optim  # noqa: E402
from embedlib.dynamic import reference  # noqa: E402
from timing import interleaved, print_table  # noqa: E402

FIXED, DYNAMIC = "fixed: ShardedEmbed step", "dynamic: DynamicEmbed step"
FIXED_EVAL, DYNAMIC_EVAL = "fixed: lookup only", "dynamic: eval lookup only"


def raw_ids(n, seed):
  """Zipf(1.05) ranks as spread 64-bit raw ids (uint64)."""
  ranks = np.random.default_rng(seed).zipf(1.05, n).astype(np.uint64)
  return ranks * np.uint64(0x9E3779B97F4A7C15)


def loss_fn(model, ids):
  return jnp.mean(jnp.sum(model(ids), -1) ** 2)


@nnx.jit(donate_argnums=(0, 1))
def fixed_step(emb, opt, ids):
  loss, grads = optim.value_and_grad(loss_fn)(emb, ids)
  opt.update(emb, grads)
  return loss


@nnx.jit(donate_argnums=(0, 1))
def dynamic_step(emb, opt, words):
  loss, grads = optim.value_and_grad(loss_fn)(emb, words)
  dynamic.reset_slots(opt, emb)
  opt.update(emb, grads)
  return loss


@nnx.jit
def lookup(emb, ids):
  return emb(ids)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", "--smoke", action="store_true")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--zeros-init", action="store_true",
                      help="the dynamic table's rows start at zero: its step without the draws")
  args = parser.parse_args(argv)
  rows, width, n = (65_536, 16, 4_096) if args.quick else (1 << 20, 64, 65_536)
  repeats = args.repeats or (5 if args.quick else 7)
  rule = optim.RowWiseAdagrad(learning_rate=0.01)
  fixed = embedlib.ShardedEmbed(rows, width, rngs=nnx.Rngs(0))
  init = {"embedding_init": nnx.initializers.zeros} if args.zeros_init else {}
  dyn = embedlib.DynamicEmbed(rows, width, bucket_size=128, rngs=nnx.Rngs(0), **init)
  fixed_opt = optim.SparseAwareOptimizer(fixed, None, rule)
  dyn_opt = optim.SparseAwareOptimizer(dyn, None, rule)
  batches = [raw_ids(n, seed) for seed in range(4 + 2 * repeats)]
  hashed = [jnp.asarray((b % np.uint64(rows)).astype(np.int32)) for b in batches]
  words = [dynamic.words(b) for b in batches]
  ref = reference.Reference(dyn.policy)
  for b, w in zip(batches[:3], words[:3]):    # warm: a running table's map
    dynamic_step(dyn, dyn_opt, w)
    ref.step(reference.as_uint64(b))
  if dyn.resident() != ref.resident():
    print("check: FAILED: the dynamic map differs from the reference's after the warm steps")
    return 1
  print(f"check: ok (the map equals the reference's: {len(ref.resident()):,} resident ids)")
  # Each timed step takes the next batch, so each admits new ids (and draws
  # their rows) as a running job's steps do.
  fresh = iter(range(3, len(batches)))
  graphdef, state = nnx.split(dyn)          # a copy: the train step donates dyn's arrays
  frozen = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
  frozen.eval()
  cases = {
      FIXED: (lambda ids: fixed_step(fixed, fixed_opt, ids), (hashed[0],)),
      DYNAMIC: (lambda: dynamic_step(dyn, dyn_opt, words[next(fresh)]), ()),
      FIXED_EVAL: (lambda ids: lookup(fixed, ids), (hashed[0],)),
      DYNAMIC_EVAL: (lambda w: lookup(frozen, w), (words[0],)),
  }
  times = interleaved(cases, repeats)
  print_table({k: times[k] for k in (FIXED, DYNAMIC)}, FIXED,
              f"train step, {rows:,} x {width} f32, {n:,} Zipf ids, {jax.default_backend()}")
  print_table({k: v for k, v in times.items() if k not in (FIXED, DYNAMIC)}, FIXED_EVAL,
              "lookup only")
  print(f"\nmap bytes per row: {dyn.policy.map_bytes_per_row():.0f}; "
        f"distinct ids in a batch: {len(np.unique(batches[0])):,}; last step: {dyn.stats()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
