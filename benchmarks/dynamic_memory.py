"""Peak host memory of a training run with a dynamic table, against its state.

    python3 benchmarks/dynamic_memory.py               # 1M x 64 f32, 65,536 Zipf ids a step
    python3 benchmarks/dynamic_memory.py --rows 65536  # full after two steps: every step evicts
    python3 benchmarks/dynamic_memory.py --quick       # small, a smoke run
    python3 benchmarks/dynamic_memory.py --json run.json   # also the run's record (timing.Run)

Each run is its own process (this script with ``--worker``): one CPU device,
a ``DynamicEmbed(rows, 64)`` (LRU, buckets of 128, admitted on first
sight) trained by ``embedlib.optim`` with row-wise AdaGrad, the step of
``benchmarks/dynamic_lookup.py`` (jitted, its state donated; the slots of
placed rows reset by ``dynamic.reset_slots``), ``--steps`` steps of new
Zipf batches; it prints its peak resident set (``VmHWM``). The same program
with a 1,024-row table gives the process constant (Python, jax, the
compiled step, the batches). "State" is the table, its AdaGrad slot and the
map (``Policy.map_bytes_per_row``: 16 bytes a row): ``rows * (64 * 4 + 4 +
16)`` bytes. Target: ``(peak - constant) / state <= 1.3``. With
``--fixed`` a ``ShardedEmbed`` of the same size runs the same steps on the
ids hashed mod its rows (state without the map), for comparison.
``--json FILE`` keeps the run's record (``benchmarks/timing.py``): each
kind's state, constant and peak in MiB, and the ratio
``<kind>_peak_over_state`` ((peak - constant) / state), beside the
machine's state (a copy probe between the runs).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import timing  # noqa: E402

TINY = 1024
WIDTH = 64
MiB = 1 << 20


def peak_rss() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def worker(args) -> None:
  sys.path[:0] = [HERE, ROOT]
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import embedlib
  from embedlib import dynamic, host_memory, optim
  import dynamic_lookup as bench

  rule = optim.RowWiseAdagrad(learning_rate=0.01)
  if args.kind == "fixed":
    emb = embedlib.ShardedEmbed(args.rows, WIDTH, rngs=nnx.Rngs(0))
    step = bench.fixed_step
    feed = lambda b: jnp.asarray((b % np.uint64(args.rows)).astype(np.int32))
  else:
    emb = embedlib.DynamicEmbed(args.rows, WIDTH, dynamic=embedlib.DynamicSpec(bucket_size=128),
                                rngs=nnx.Rngs(0))
    step = bench.dynamic_step
    feed = dynamic.words
  opt = optim.SparseAwareOptimizer(emb, None, rule)
  host_memory.release_freed()
  built = peak_rss()
  for seed in range(args.steps):
    loss = step(emb, opt, feed(bench.raw_ids(args.ids, seed)))
  jax.block_until_ready(loss)
  extra = ""
  if args.kind == "dynamic":
    extra = f" occupancy {emb.stats()['occupancy']:.3f} evicted {emb.stats()['evicted']}"
  print(f"@@peak {peak_rss()} built {built}{extra}", flush=True)


def run(kind: str, rows: int, args) -> tuple[int, int, str]:
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--kind", kind,
         "--rows", str(rows), "--ids", str(args.ids), "--steps", str(args.steps)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"the {kind} worker with {rows} rows exited {out.returncode}:\n"
                       f"{out.stderr[-3000:]}")
  line = next(l for l in out.stdout.splitlines() if l.startswith("@@peak "))
  words = line.split()
  return int(words[1]), int(words[3]), " ".join(words[4:])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=1 << 20)
  parser.add_argument("--ids", type=int, default=65_536, help="ids a step")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--fixed", action="store_true", help="also the fixed table's run")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--kind", default="dynamic", help=argparse.SUPPRESS)
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  if args.worker:
    worker(args)
    return 0
  record = timing.Run("dynamic_memory", argv, smoke=args.quick)
  if args.quick:
    args.rows, args.ids, args.steps = 16_384, 4_096, 4
  kinds = ["dynamic"] + (["fixed"] if args.fixed else [])
  print(f"{args.rows:,} x {WIDTH} f32 table, {args.ids:,} Zipf ids a step, {args.steps} steps, "
        "one CPU device; peak RSS (VmHWM) of each run in its own process")
  worst = 0.0
  for kind in kinds:
    per_row = WIDTH * 4 + 4 + (16 if kind == "dynamic" else 0)
    state = args.rows * per_row
    constant, _, _ = run(kind, TINY, args)
    constant -= TINY * per_row
    record.probe()
    peak, built, note = run(kind, args.rows, args)
    record.probe()
    ratio = (peak - constant) / state
    worst = max(worst, ratio) if kind == "dynamic" else worst
    print(f"{kind:8s} state {state / MiB:7.1f} MiB ({per_row} B a row); process constant "
          f"{constant / MiB:7.1f} MiB; built {built / MiB:7.1f} MiB; peak {peak / MiB:7.1f} MiB; "
          f"(peak - constant) / state = {ratio:.2f} (target <= 1.3){';' if note else ''}{note}")
    for what, value in (("state", state), ("process constant", constant), ("built", built),
                        ("peak", peak)):
      record.add_case(f"{kind}: {what}", value / MiB, "MiB")
    record.ratio(f"{kind}_peak_over_state", ratio)
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
