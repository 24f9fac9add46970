"""DLRM's dot interaction on CPU: the C++ kernel against XLA's pairs, forward and training.

    python3 benchmarks/interaction.py               # 27 vectors of [2048, 64] (DLRM's), 30 rounds
    python3 benchmarks/interaction.py --quick       # small sizes, a smoke run
    python3 benchmarks/interaction.py --json run.json   # also the run's record (timing.Run)

One CPU device. The vectors are those of DLRM's interaction at the Criteo
config's batch: the bottom MLP's output and 26 table vectors, float32. Two
parts, each a jitted program timed interleaved with its XLA counterpart:

- forward: the pairs as a training step computes them (``jax.vjp``'s
  primal: ``kernels.interaction.dot_pairs`` runs the kernel where it is
  differentiated) against ``pairs_xla``'s;
- training: ``jax.value_and_grad`` of ``sum(pairs * cotangent)``, forward
  and backward, against the same through ``pairs_xla``.

Before timing, each kernel case's result is checked against XLA's to float32
rounding (exit status 1 if it differs). Ratios: ``xla_over_kernel_forward``
and ``xla_over_kernel_training`` (XLA's median time over the kernel's).
Never asserts a time. A sample is ``--inner`` calls back to back (default 8;
1 before 2026-12-07's eighth session), in ms a call: one call timed alone
pays the machine's wake-up (``benchmarks/README.md``, "One step timed
alone").
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import timing  # noqa: E402
from embedlib.kernels import cpu_library, interaction  # noqa: E402

VECTORS, BATCH, WIDTH = 27, 2048, 64


def cases(vectors, cot):
  """name -> (jitted fn, args): the forward and the training program, kernel and XLA."""
  def forward(pairs):
    return jax.jit(lambda v: jax.vjp(pairs, v)[0])

  def training(pairs):
    return jax.jit(jax.value_and_grad(lambda v, c: jnp.sum(pairs(v) * c)))

  out = {}
  for part, make in (("forward", forward), ("training", training)):
    args = (vectors,) if part == "forward" else (vectors, cot)
    out[f"{part}, kernel"] = (make(interaction.dot_pairs), args)
    out[f"{part}, XLA pairs"] = (make(interaction.pairs_xla), args)
  return out


def check(timed) -> list[str]:
  """Each kernel case's result against XLA's: the cases that differ beyond rounding."""
  bad = []
  for part in ("forward", "training"):
    (fn, args), (ref, _) = timed[f"{part}, kernel"], timed[f"{part}, XLA pairs"]
    for got, want in zip(jax.tree.leaves(fn(*args)), jax.tree.leaves(ref(*args))):
      if not np.allclose(got, want, rtol=1e-5, atol=1e-3):
        bad.append(part)
        break
  return bad


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
  parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 30, 3 quick)")
  timing.add_inner_argument(parser, since="2026-12-07's eighth session")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  timing.check_inner(parser, args.inner)
  if not cpu_library.available():
    print("the CPU kernels' library is not available (no C++ compiler, or "
          "EMBEDLIB_CPU_KERNELS=0): nothing to compare")
    return 1
  n, batch, width = (5, 64, 16) if args.quick else (VECTORS, BATCH, WIDTH)
  repeats = args.repeats or (3 if args.quick else 30)
  record = timing.Run("interaction", argv, smoke=args.quick)
  rng = np.random.default_rng(0)
  vectors = [jnp.asarray(rng.standard_normal((batch, width)), jnp.float32) for _ in range(n)]
  cot = jnp.asarray(rng.standard_normal((batch, n * (n - 1) // 2)), jnp.float32)
  timed = cases(vectors, cot)
  bad = check(timed)
  if bad:
    print(f"the kernel's {', '.join(bad)} differs from XLA's pairs beyond rounding: not timed")
    return 1
  print(f"{n} vectors of [{batch}, {width}] f32 ({n * (n - 1) // 2} pairs), one CPU device; "
        f"{repeats} interleaved rounds")
  times = timing.interleaved(timed, repeats, shuffle_seed=0, between_rounds=record.probe,
                             calls=args.inner)
  timing.print_table(times, "forward, kernel", "ms per call: min / median / max")
  record.add_times(times)
  for part in ("forward", "training"):
    record.ratio(f"xla_over_kernel_{part}",
                 timing.median_ratio(times[f"{part}, XLA pairs"], times[f"{part}, kernel"]))
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
