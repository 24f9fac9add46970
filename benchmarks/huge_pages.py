"""The sparse step with its table on 2 MiB pages and on malloc's 4 KiB ones, in one run.

    python3 benchmarks/huge_pages.py              # 1M x 64 and 10M x 32 f32, 65,536 Zipf ids
    python3 benchmarks/huge_pages.py --quick      # 100k x 64 and 1M x 32 (a smoke run)
    python3 benchmarks/huge_pages.py --json run.json   # also the run's record (timing.Run)

The CPU kernels move a table of 32 MiB or more onto transparent huge pages
the second time they meet it (``embedlib/kernels/cpu/huge_pages.h``); a
process with ``EMBEDLIB_HUGE_PAGES=0`` keeps malloc's pages. The choice is
per process and one-way, so each side is a worker of its own
(``peers/worker_protocol.py``) holding ``sparse_step.py``'s sparse step
(lookup, loss, fused row-wise AdaGrad update, the state donated). Each
request runs ``--steps`` steps; the workers' requests alternate in a
shuffled order each round, with the memory-copy probe between rounds.

Printed, per table: each side's step time (min / median / max ms); its
first step, which compiles the step and, on huge pages, also moves the
table and its accumulators there (the move's cost is the difference of the
two first steps); and the table's bytes on huge pages, from the worker's
``/proc/self/smaps``. Named ratios: ``small_over_huge_<size>``, the step
on 4 KiB pages over the step on 2 MiB pages (medians: the speed-up), and
``move_ms_<size>``, the first steps' difference in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))

import timing  # noqa: E402
from timing import print_table  # noqa: E402
from worker_protocol import Worker, default_env, sample_ms, serve  # noqa: E402

HUGE, SMALL = "2 MiB pages (the kernels' advice)", "4 KiB pages (EMBEDLIB_HUGE_PAGES=0)"
SIZES = ((1_000_000, 64), (10_000_000, 32))
QUICK_SIZES = ((100_000, 64), (1_000_000, 32))


def huge_page_bytes(address: int, nbytes: int) -> int:
  """AnonHugePages of this process's mappings over [address, address + nbytes)."""
  total, overlaps = 0, False
  with open("/proc/self/smaps") as f:
    for line in f:
      vma = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
      if vma:
        overlaps = int(vma[1], 16) < address + nbytes and address < int(vma[2], 16)
      elif overlaps and line.startswith("AnonHugePages:"):
        total += int(line.split()[1]) * 1024
  return total


def worker(vocab: int, width: int, n: int) -> None:
  """Serves ``sparse_step``'s sparse step on one table (``serve``)."""
  import jax
  import sparse_step

  ids = sparse_step.zipf_ids(n, vocab)
  stepper = sparse_step.Stepper(*sparse_step.build_step(vocab, width, True))
  jax.block_until_ready(stepper.state)
  first = stepper.timed(ids)
  stepper.timed(ids)
  table, _ = sparse_step.table_and_acc(stepper.state)
  on_huge = huge_page_bytes(table.unsafe_buffer_pointer(), table.nbytes)

  def run_steps(steps):
    for _ in range(steps):
      stepper(ids)
    jax.block_until_ready(stepper.state)
    return float(stepper.loss)

  serve(run_steps, {"first_step_ms": first, "table_mib": table.nbytes / (1 << 20),
                    "table_mib_on_huge_pages": on_huge / (1 << 20)})


def time_sides(vocab, width, n, repeats, steps, record):
  """Both sides' workers on one table, timed in shuffled rounds; name -> ms per step."""
  argv = [sys.executable, os.path.abspath(__file__), "--worker", "--vocab", str(vocab),
          "--width", str(width), "--ids", str(n)]
  envs = {HUGE: default_env(), SMALL: default_env(EMBEDLIB_HUGE_PAGES="0")}
  envs[HUGE].pop("EMBEDLIB_HUGE_PAGES", None)
  workers, info = {}, {}
  try:
    for name, env in envs.items():   # one at a time: their first steps are timed
      workers[name] = Worker(name, argv, env)
      info[name] = workers[name].ready()
      print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in info[name].items()))
    times = {name: [] for name in workers}
    rng = random.Random(0)
    for _ in range(repeats):
      order = list(workers)
      rng.shuffle(order)
      for name in order:
        times[name].append(sample_ms(workers[name], steps))
      record.probe()
    for w in workers.values():
      w.close()
  finally:
    for w in workers.values():
      w.kill()
  return times, info


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
  parser.add_argument("--repeats", type=int, default=None, help="timed rounds")
  parser.add_argument("--steps", type=int, default=5, help="steps per request")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--ids", type=int, default=65_536, help=argparse.SUPPRESS)
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  if args.worker:
    return worker(args.vocab, args.width, args.ids)
  record = timing.Run("huge_pages", argv, smoke=args.quick)
  repeats = args.repeats or (3 if args.quick else 15)
  n = 8192 if args.quick else 65_536
  for vocab, width in QUICK_SIZES if args.quick else SIZES:
    tag = timing.size_tag(vocab, width)
    print(f"\n{vocab:,} x {width} f32 table, {n:,} Zipf(1.05) ids, {args.steps} steps a request")
    start = time.perf_counter()
    times, info = time_sides(vocab, width, n, repeats, args.steps, record)
    print(f"  built and timed in {time.perf_counter() - start:.0f} s")
    print_table(times, SMALL, f"{tag}: the sparse step, {repeats} interleaved rounds, ms")
    record.add_times(times, prefix=f"{tag}: ")
    for name in info:
      record.add_case(f"{tag}: first step, {name}", info[name]["first_step_ms"])
      record.add_case(f"{tag}: table on huge pages, {name}",
                      info[name]["table_mib_on_huge_pages"], unit="MiB")
    record.ratio(f"small_over_huge_{tag}", timing.median_ratio(times[SMALL], times[HUGE]))
    record.ratio(f"move_ms_{tag}", info[HUGE]["first_step_ms"] - info[SMALL]["first_step_ms"])
  record.finish(args.json)


if __name__ == "__main__":
  main()
