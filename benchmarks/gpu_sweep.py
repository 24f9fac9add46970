"""The GPU sweep: every lookup kernel's variants beside XLA's ops and torch, each checked, then timed.

Run on one NVIDIA GPU (``gpu_session.sh`` runs it)::

  python benchmarks/gpu_sweep.py --json benchmarks/results/gpu_$(date +%F).json
  python benchmarks/gpu_sweep.py --smoke --json /tmp/sweep.json   # any backend, tiny: tests the script

For 1M x 128 and 10M x 64 tables, float32 and bfloat16 (and the int8 / int4
rows of ``embedlib.quantize``), uniform and Zipf(1.05) ids, 65,536 ids a
call, it times each kernel's variants (``kernels/rows.py``: rows, bags,
pieces per program, unroll, warps) beside the baselines measured in the same
run:

- ``gather``: ``xla`` (``jnp.take``), the Triton rows kernels
  (``triton-rows-gather-...``), the Mosaic GPU and first Triton kernels
  (``mosaic-tma``, ``triton-tile``), ``torch.nn.functional.embedding``;
- ``bag16`` / ``bag64`` (sum bags of 16 and 64 ids): ``xla`` (take +
  segment_sum), ``xla-slots`` (``kernel="xla"``'s bag), the rows kernels,
  ``mosaic-tma``, ``triton-tile``, ``torch.nn.functional.embedding_bag``;
- ``backward`` (one summed row per distinct id): ``xla`` (a scatter-add,
  indices colliding), ``xla-sorted`` (the sorted update's scan), the rows
  segment kernels, ``mosaic-tma``;
- ``update-sgd`` / ``-adagrad`` / ``-adam`` (float32): ``xla-ops``
  (``apply.py``), ``xla-sorted`` (the sorted update, the default), the fused
  rows kernels, ``mosaic-tma`` (the fused Mosaic kernel).

A 1 GiB device-to-device copy is timed first (the ``copy`` case): after
the lookups, each group's fastest rows kernel is judged against issue 54's
targets by its share of that copy and its speed-up over the best XLA path
(`targets`).

Every variant is first run once and compared with its reference (a lookup
with the pure-jnp reference on the float32 table, the update with the XLA
ops): a variant that disagrees is reported, kept out of the timings and
marked ``"check": false``. Each variant is one program, compiled ahead of
time (a group's in parallel), that the check runs once and the timing
``--inner`` times (a lookup: calls in one jitted loop; an update: donated
steps), ``--repeats`` times, min / median / max. Then the sparse train step
(``gpu_steps.py``'s, 10M x 64) and the quickstart DLRM step (batch 65,536)
run with ``kernel="auto"`` on the table this run's cases give
(``gpu_choice.table_from_results``) against ``kernel="xla"`` with the XLA
update, checked against each other first.

``--json FILE`` writes the run's record (``timing.Run``: the machine beside
the figures) whose ``cases`` are the sweep's, each with ``kernel``,
``variant``, ``shape``, ``dtype``, ``ids``, ``median_us`` (and ``min_us``,
``max_us``, ``check``, ``device``, and the record's ``name``, ``min``,
``median``, ``max``, ``unit``), and whose ``ratios`` are each group's best
rows kernel over its best XLA path (``rows_vs_xla_<kernel>_<table>_<dtype>_<ids>``)
and each step's ``auto`` over ``xla``. Keep a GPU run's file as
``benchmarks/results/gpu_<date>.json`` and run ``python
benchmarks/gpu_table.py``: ``auto`` then runs what it measured fastest.
Never asserts a time; without a GPU (and without ``--smoke``) it measures
nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gpu_cases  # noqa: E402
import timing  # noqa: E402
from gpu_lookup import COPY_BYTES, copy_bandwidth, make_ids, torch_ops  # noqa: E402
from gpu_static import moved_bytes  # noqa: E402

TABLES = ((1_000_000, 128), (10_000_000, 64))
DTYPES = ("float32", "bfloat16", "int8", "int4")
DISTRIBUTIONS = ("uniform", "zipf")
NUM_IDS = 65_536
LOOKUPS = gpu_cases.LOOKUPS


def compile_all(programs: dict, workers: int) -> dict:
  """``name -> compiled`` for ``name -> (jitted fn, args, context)``, compiled in parallel threads.

  Tracing and lowering run in this thread, inside each program's context
  (the switches that choose a kernel); XLA's compiles, the slow part, in
  the pool. A program that fails to compile maps to its exception.
  """
  lowered = {}
  for name, (fn, args, context) in programs.items():
    try:
      with context():
        lowered[name] = fn.lower(*args)
    except Exception as e:  # reported as a failed check, the sweep goes on
      lowered[name] = e
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    futures = {n: pool.submit(lambda l: l.compile(), l) for n, l in lowered.items()
               if not isinstance(l, Exception)}
  out = {}
  for name, low in lowered.items():
    if isinstance(low, Exception):
      out[name] = low
      continue
    try:
      out[name] = futures[name].result()
    except Exception as e:
      out[name] = e
  return out


def seconds(compiled, case, distribution, inner: int, repeats: int) -> np.ndarray:
  """Seconds per call: a `gpu_cases.timed_loop` of ``inner`` calls, or ``inner`` donated steps."""
  args = case.make(distribution)
  if case.donated:
    state, rest = args[0], args[1:]
    state = compiled(state, *rest)
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      for _ in range(inner):
        state = compiled(state, *rest)
      jax.block_until_ready(state)
      times.append((time.perf_counter() - start) / inner)
    return np.array(times)
  args = (*args[:-1], jnp.int32(inner))
  jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append((time.perf_counter() - start) / inner)
  return np.array(times)


def one_call(compiled, case):
  """The output of one call on the first distribution's ids (what the check compares)."""
  out = compiled(*case.make(None))
  return out if case.donated else out[1]


def keep(record: timing.Run, case: dict, secs=None) -> None:
  """A sweep case in the run's record: its figures in µs, under the record's keys and its own."""
  if secs is not None:
    us = [float(x) * 1e6 for x in secs]
    case = dict(case, median_us=float(np.median(us)), min_us=min(us), max_us=max(us))
  name = " ".join([case["kernel"], "x".join(map(str, case["shape"])), case["dtype"], case["ids"],
                   case["variant"]])
  record.cases.append(dict(case, name=name, min=case["min_us"], median=case["median_us"],
                           max=case["max_us"], unit="us", n=0 if secs is None else len(secs)))


def ratios(record: timing.Run) -> None:
  """Each measured group's best rows kernel over its best XLA path, and each step's auto / xla."""
  groups: dict[tuple, dict[str, float]] = {}
  for c in record.cases:
    if c["median_us"] is not None:
      key = (c["kernel"], "x".join(map(str, c["shape"])), c["dtype"], c["ids"])
      groups.setdefault(key, {})[c["variant"]] = c["median_us"]
  for (kernel, shape, dtype, ids), times in groups.items():
    if kernel.startswith("step-") and {"auto", "xla"} <= set(times):
      record.ratio(f"auto_vs_xla_{kernel}", times["xla"] / times["auto"])
      continue
    base = min((t for v, t in times.items() if v in ("xla", "xla-slots", "xla-sorted",
                                                      "xla-ops")), default=None)
    rows = min((t for v, t in times.items() if v.startswith("triton-rows-")), default=None)
    if base and rows:
      record.ratio(f"rows_vs_xla_{kernel}_{shape}_{dtype}_{ids}", base / rows)


XLA_PATHS = ("xla", "xla-slots", "xla-sorted", "xla-ops")


def targets(record: timing.Run, copy_bps: float, num_ids: int) -> None:
  """Issue 54's targets against each measured group's best rows kernel, printed and kept as ratios.

  The share of the copy is the fewest bytes the call moves
  (``gpu_static.moved_bytes``) per second over the copy's bytes (read +
  write) per second. Targets: gather 80% of the copy, and 1.2x XLA where
  XLA is below 70%; bags 1.5x the best XLA path; the update 30% of the
  copy and faster than the sorted XLA update.
  """
  groups: dict[tuple, dict[str, float]] = {}
  for c in record.cases:
    if c["median_us"] is not None and c["kernel"] in gpu_cases.LOOKUPS:
      key = (c["kernel"], tuple(c["shape"]), c["dtype"], c["ids"])
      groups.setdefault(key, {})[c["variant"]] = c["median_us"] * 1e-6
  print(f"\ntargets (issue 54), copy {copy_bps / 1e9:.1f} GB/s read + write:")
  for (kernel, (rows, features), dtype, ids), times in sorted(groups.items()):
    rows_times = {v: t for v, t in times.items() if v.startswith("triton-rows-")}
    xla = {v: t for v, t in times.items() if v in XLA_PATHS}
    if not rows_times or not xla:
      continue
    variant, t = min(rows_times.items(), key=lambda kv: kv[1])
    base = min(xla.values())
    uniq = len(np.unique(make_ids(rows, num_ids, ids)))
    share = moved_bytes(kernel, dtype, rows, features, uniq, n=num_ids) / t / copy_bps
    tag = f"{kernel}_{rows}x{features}_{dtype}_{ids}"
    record.ratio(f"share_of_copy_{tag}", share)
    if kernel == "gather":
      xla_share = share * t / base
      met = share >= 0.8 and (xla_share >= 0.7 or base / t >= 1.2)
      goal = "80% of copy, 1.2x XLA where XLA < 70%"
    elif kernel.startswith("bag"):
      met, goal = base / t >= 1.5, "1.5x the best XLA path"
    elif kernel.startswith("update-"):
      met = share >= 0.3 and t < xla.get("xla-sorted", float("inf"))
      goal = "30% of copy and faster than xla-sorted"
    else:
      met, goal = None, "none (backward)"
    verdict = {True: "MET", False: "not met", None: "-"}[met]
    print(f"  {kernel:<15}{rows}x{features:<6}{dtype:<9}{ids:<8}{variant:<38}{share:6.1%} of copy "
          f"{base / t:5.2f}x best XLA  target {goal}: {verdict}")


def run_group(group: gpu_cases.Group, args, torch_timer, record) -> None:
  """Checks, then times, one (kernel, table, dtype)'s variants on both id distributions."""
  started = time.monotonic()
  programs = compile_all({v: (c.fn, c.abstract, c.context) for v, c in group.variants.items()},
                         args.workers)
  print(f"  ({len(programs)} programs compiled in {time.monotonic() - started:.1f} s)")
  reference = group.reference()
  for variant, case in group.variants.items():
    compiled = programs[variant]
    ok, err = False, f"did not compile: {compiled}"
    if not isinstance(compiled, Exception):
      ok, err = group.check(one_call(compiled, case), reference)
    print(f"check {group.kernel} {group.label} {variant}: {err if not ok else 'ok'}", flush=True)
    for dist in group.distributions:
      base = dict(kernel=group.kernel, variant=variant, shape=list(group.shape), dtype=group.dtype,
                  ids=dist, device=args.device, check=ok)
      if not ok:
        keep(record, dict(base, median_us=None, min_us=None, max_us=None, error=str(err)[:300]))
        continue
      keep(record, base, seconds(compiled, case, dist, args.inner, args.repeats))
  if torch_timer and group.torch:
    for dist in group.distributions:
      secs = torch_timer(group.torch, group.shape, group.dtype, group.ids_np[dist], group.bag,
                         args.inner, args.repeats)
      keep(record, dict(kernel=group.kernel, variant="torch", shape=list(group.shape),
                        dtype=group.dtype, ids=dist, device=args.device, check=True), secs)


def print_group(cases, kernel, shape, dtype) -> None:
  rows = [c for c in cases if c["kernel"] == kernel and c["shape"] == list(shape)
          and c["dtype"] == dtype]
  for dist in sorted({c["ids"] for c in rows}):
    here = [c for c in rows if c["ids"] == dist and c["median_us"] is not None]
    base = min((c["median_us"] for c in here if c["variant"].startswith("xla")), default=None)
    for c in sorted(here, key=lambda c: c["median_us"]):
      ratio = f"{base / c['median_us']:6.2f}x" if base else "     -"
      print(f"  {kernel:<15}{shape[0]}x{shape[1]:<6}{dtype:<9}{dist:<8}{c['variant']:<38}"
            f"{c['min_us']:9.1f}{c['median_us']:9.1f}{c['max_us']:9.1f} {ratio}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--inner", type=int, default=20)
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds after which no new lookup group starts (the steps still run)")
  parser.add_argument("--kernels", default=",".join(LOOKUPS), help="comma-separated subset")
  parser.add_argument("--no-steps", action="store_true", help="the lookups alone")
  parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                      help="threads compiling programs in parallel")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes on any backend (kernels interpreted on a CPU): tests the "
                      "script; its numbers mean nothing")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  backend = jax.default_backend()
  tables, dtypes, dists, num_ids = TABLES, DTYPES, DISTRIBUTIONS, NUM_IDS
  if args.smoke:
    tables, dtypes, dists, num_ids = ((300, 64),), ("float32", "int8"), ("zipf",), 128
    args.inner, args.repeats = 2, 2
    print("gpu_sweep --smoke: tiny sizes to exercise the script; the numbers are not measurements.")
  elif backend != "gpu":
    print(f"gpu_sweep: the default jax backend is {backend!r}, not a GPU; this sweep measures "
          "GPU kernels only, so it measures nothing here.")
    return 0
  record = timing.Run("gpu_sweep", argv, smoke=args.smoke)
  args.device = jax.devices()[0].device_kind
  print(f"device: {args.device}, jax {jax.__version__}")
  torch_timer = None if args.smoke else torch_ops()
  copy_bytes = 1 << 20 if args.smoke else COPY_BYTES
  copy_bps = copy_bandwidth(copy_bytes, args.inner, args.repeats)
  # The copy's time for its bytes read and written: what "% of copy" counts against.
  keep(record, dict(kernel="copy", variant="copy", shape=[copy_bytes], dtype="float32", ids="-",
                    device=args.device, check=True), [2 * copy_bytes / copy_bps])
  cases, started = record.cases, time.monotonic()
  kernels = args.kernels.split(",")
  for rows, features in tables:
    ids_np = {d: make_ids(rows, num_ids, d) for d in dists}
    for dtype in dtypes:
      for kernel in kernels:
        if args.budget is not None and time.monotonic() - started > args.budget:
          print(f"gpu_sweep: --budget {args.budget:g} s reached; {kernel} {rows}x{features} "
                f"{dtype} not measured")
          continue
        group = gpu_cases.group(kernel, rows, features, dtype, ids_np, smoke=args.smoke)
        if group is None:
          continue
        run_group(group, args, torch_timer, record)
        print_group(cases, kernel, (rows, features), dtype)
        del group
    record.probe()   # the host's state between tables
  if not args.no_steps:
    from embedlib.kernels import gpu_choice
    table = gpu_choice.table_from_results(cases)
    print("\nauto on this run's cases (gpu_choice.table_from_results):")
    for choice in table:
      print(f"  {choice}")
    with gpu_choice.using(table):
      for step in gpu_cases.steps(smoke=args.smoke):
        ok, times = step.run(args.repeats)
        for variant, secs in times.items():
          keep(record, dict(kernel=step.kernel, variant=variant, shape=list(step.shape),
                            dtype="float32", ids=step.ids, device=args.device, check=ok), secs)
          print(f"  {step.kernel:<15}{variant:<8}{1e3 * secs.min():9.3f}"
                f"{1e3 * np.median(secs):9.3f}{1e3 * secs.max():9.3f} ms")
  failed = [c for c in cases if not c["check"]]
  ratios(record)
  targets(record, copy_bps, num_ids)
  record.finish(args.json)
  print(f"gpu_sweep: {len(cases)} cases, {len(failed)} failed their check, in "
        f"{time.monotonic() - started:.0f} s")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
