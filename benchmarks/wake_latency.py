"""Whether a woken thread works beside its waker on this machine, or after it.

    python3 benchmarks/wake_latency.py                  # bursts of 500 and 2,000 us, 300 rounds
    python3 benchmarks/wake_latency.py --busy-us 250 1000 --rounds 100
    python3 benchmarks/wake_latency.py --json run.json  # also the run's record (timing.Run)

Every CPU kernel of embedlib (``embedlib/kernels/cpu/pool.h``) wakes a
sleeping thread of XLA's pool to share a call's tasks, and each XLA:CPU
fusion split over the pool does the same. ``wake_latency.cc`` measures what
such a burst costs: a helper thread sleeps, is woken, and both threads then
work ``--busy-us`` each (a loop in registers). A round's time runs from the
wake to the later end: ``busy`` where the helper started at once on another
CPU, up to twice that where it ran on the waker's CPU first. Each burst
length is measured twice in one process: both threads free to run anywhere
(as the pool's are), and each pinned to its own CPU (the baseline: the
wake-up alone). Prints min / median / max microseconds, and the ratio
``unpinned_over_pinned_<busy>us`` of their medians; a ratio near 2 means the
machine runs short bursts of two threads one after the other. Never asserts
a time.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import timing  # noqa: E402
from timing import print_table  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wake_latency.cc")


def measure(busy_us: int, rounds: int, sleep_us: int = 2000) -> dict:
  """``wake_latency.cc``'s JSON for one burst length (built with the compiler
  embedlib's kernels use). Raises RuntimeError without a compiler or when
  the program fails."""
  from embedlib.kernels import cpu_library  # noqa: PLC0415
  cxx = cpu_library.compiler()
  if cxx is None:
    raise RuntimeError("wake_latency: no C++ compiler (set $CXX, or install g++ or clang++)")
  with tempfile.TemporaryDirectory() as tmp:
    binary = os.path.join(tmp, "wake_latency")
    build = subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", SOURCE, "-o", binary],
                           capture_output=True, text=True)
    if build.returncode != 0:
      raise RuntimeError(f"wake_latency.cc did not build with {cxx}: {build.stderr[-2000:]}")
    ran = subprocess.run([binary, str(rounds), str(sleep_us), str(busy_us)],
                         capture_output=True, text=True)
  if ran.returncode != 0:
    raise RuntimeError(f"wake_latency failed (exit status {ran.returncode}): {ran.stderr[-2000:]}")
  return json.loads(ran.stdout)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--busy-us", type=int, nargs="+", default=[500, 2000],
                      help="each thread's work after the wake, in microseconds (default 500 2000)")
  parser.add_argument("--rounds", type=int, default=300)
  parser.add_argument("--smoke", action="store_true", help="a few rounds of short bursts")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  if args.rounds < 1 or min(args.busy_us) < 1:
    parser.error("--rounds and every --busy-us must be at least 1")
  busy, rounds = ([200], 5) if args.smoke else (args.busy_us, args.rounds)
  record = timing.Run("wake_latency", argv, smoke=args.smoke)
  for us in busy:
    result = measure(us, rounds)
    times = {f"{us} us each, unpinned": [t / 1000 for t in result["any_cpu_us"]]}
    if result["pinned_us"]:
      times[f"{us} us each, pinned apart"] = [t / 1000 for t in result["pinned_us"]]
    record.probe()
    baseline = next(reversed(times))
    print_table(times, baseline, f"a burst of two threads, {us} us each, ms from the wake to "
                                 f"both ends ({result['cpus']} CPUs, {rounds} rounds)")
    late = sum(t > 1.5 * us for t in result["any_cpu_us"]) / len(result["any_cpu_us"])
    print(f"unpinned rounds over 1.5 x {us} us: {late:.0%}")
    record.add_times(times)
    record.ratio(f"late_share_{us}us", late)
    if result["pinned_us"]:
      record.ratio(f"unpinned_over_pinned_{us}us",
                   timing.median_ratio(times[f"{us} us each, unpinned"], times[baseline]))
    else:
      record.note("one CPU: no pinned baseline")
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
