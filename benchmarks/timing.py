"""Shared timing helpers for the benchmarks, and the record of a run (``--json``).

Benchmarks report ratios against a baseline measured in the same run, never
absolute pass/fail times: these machines are shared and noisy. Timing:
``interleaved`` (round-robin repeats), ``summary`` and ``print_table``
(min / median / max and the ratio of medians).

The record: the same code gave 1.17x and 4.01x FBGEMM on two machines of
one kind, so a figure is only as good as the record of the machine that made
it. Every benchmark keeps a ``Run``::

    run = timing.Run("sparse_step", argv, smoke=args.quick)   # load, /proc/stat, a probe
    times = interleaved(cases, repeats, between_rounds=run.probe)
    run.add_times(times)
    run.ratio("vs_fbgemm_1M_x_64", timing.median_ratio(times[FBGEMM], times[OURS]))
    run.finish(args.json)      # prints the machine's state; writes FILE with --json FILE

and ``--json FILE`` (``add_json_argument``) writes::

    {"benchmark", "commit", "dirty", "date", "command", "smoke",
     "machine": {"cores", "load_before", "load_after", "steal_pct", "copy_gbps": [...],
                 "copy_spread", "probe_mib"},
     "cases": [{"name", "min", "median", "max", "unit"}, ...],
     "ratios": {name: value}, "noisy", "quiet", "not_quiet_because": [...], "notes": [...]}

- ``load_before`` / ``load_after``: the 1-minute load average
  (``os.getloadavg``) when the run starts and when it finishes; ``cores``:
  ``os.cpu_count()``.
- ``steal_pct``: the share of the CPU time the hypervisor gave to others
  over the run (``steal`` of ``/proc/stat``'s ``cpu`` line over all its
  time), ``null`` where there is no ``/proc/stat``.
- ``copy_gbps``: the memory-copy probe, one per round: ``np.copyto`` of a
  buffer past the last-level cache (twice its size, 64 to 512 MiB; 8 MiB in
  a smoke run), the median of five copies after a pause that lets the
  benchmark's spinning worker threads go idle, in GB/s of bytes read plus
  written, in a process of its own that holds the buffers only while it
  probes (``CopyProbe``). It is taken when the run starts, after every
  round of the benchmark's timing loops (``between_rounds``) and, if that
  made fewer than two, when it finishes. Its ``copy_spread`` is the 90th over
  the 10th percentile, less 1 (``spread``; fastest over slowest under ten
  probes); over ``NOISY_SPREAD`` (20%) the run is ``noisy``, and says so
  beside its ratios.
- ``commit``: ``git rev-parse --short HEAD`` of this checkout; ``dirty``:
  whether tracked files differ from it (then the commit does not name the
  code that ran). ``command``: the command line, less its ``--json FILE``.
  ``smoke``: the run took the script's smoke sizes (``--quick`` /
  ``--smoke``), whose figures are not headline figures.

A run is **quiet** (``quiet_reasons`` returns nothing) when the machine was
idle as it started and stayed steady through it:

- ``load_before`` at most ``QUIET_LOAD_PER_CORE`` (0.25) times the cores
  (0.5 on the 2-core machines): nobody else's work was queued as it began;
- ``steal_pct`` at most ``QUIET_STEAL_PCT`` (2%): the hypervisor did not
  hand the cores to other machines;
- at least two probes, spread at most ``NOISY_SPREAD`` (20%): the memory
  bandwidth, which these benchmarks are bound by, held still over the run.

``load_after`` is recorded, not judged: it includes the benchmark's own
threads. Only quiet, full-size runs at a clean commit are kept under
``benchmarks/results/`` (``python3 benchmarks/results_table.py --keep
FILE``), and the table that opens ``benchmarks/README.md`` is generated
from them.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A quiet run starts at a load average of at most this times the cores.
QUIET_LOAD_PER_CORE = 0.25
#: ... loses at most this share of CPU time (%) to the hypervisor ...
QUIET_STEAL_PCT = 2.0
#: ... and its copy probes differ by at most this (fastest / slowest - 1);
#: past it the run is noisy.
NOISY_SPREAD = 0.20
#: The probe's buffer: twice the last-level cache, within these bounds.
PROBE_BYTES_RANGE = (64 << 20, 512 << 20)
SMOKE_PROBE_BYTES = 8 << 20
#: The keys every ``--json`` file holds (the issue's format).
KEYS = ("commit", "date", "command", "machine", "cases", "ratios")
MACHINE_KEYS = ("load_before", "load_after", "steal_pct", "copy_gbps")
CASE_KEYS = ("name", "min", "median", "max", "unit")


# -- timing -------------------------------------------------------------------


def time_once(fn, *args) -> float:
  return time_calls(fn, args)


def time_calls(fn, args, calls: int = 1) -> float:
  """Milliseconds per call of ``calls`` calls of ``fn(*args)`` back to back, each waited for.

  Several calls a sample, as training makes them: on the 2-core VMs one call
  timed alone, after the process idled or ran other work, pays the
  machine's wake-up (about a millisecond; ``benchmarks/README.md``, "One
  step timed alone").
  """
  import jax  # pylint: disable=g-import-not-at-top  (train_dlrm's parent runs no jax)

  start = time.perf_counter()
  for _ in range(calls):
    jax.block_until_ready(fn(*args))
  return (time.perf_counter() - start) * 1e3 / calls


def interleaved(cases: dict, repeats: int, *, shuffle_seed: int | None = None,
                between_rounds=None, calls: int = 1) -> dict[str, list[float]]:
  """Times every case ``repeats`` times, round-robin, after one warm-up each.

  Args:
    cases: name -> (fn, args).
    repeats: timed samples per case.
    calls: calls per sample, back to back (``time_calls``); ms per call.
    shuffle_seed: None keeps the order of ``cases`` every round; a seed
      shuffles each round's order (seeded), so that no case always runs
      behind the same predecessor and inherits its cache footprint and the
      freeing of its buffers.
    between_rounds: called after every round (``Run.probe``), or None.

  Returns:
    name -> list of milliseconds.
  """
  import jax  # pylint: disable=g-import-not-at-top

  for fn, args in cases.values():
    jax.block_until_ready(fn(*args))
  times = {name: [] for name in cases}
  order, rng = list(cases), random.Random(shuffle_seed)
  for _ in range(repeats):
    if shuffle_seed is not None:
      rng.shuffle(order)
    for name in order:
      fn, args = cases[name]
      times[name].append(time_calls(fn, args, calls))
    if between_rounds is not None:
      between_rounds()
  return times


def summary(times: list[float]) -> str:
  return f"{min(times):8.2f} {statistics.median(times):8.2f} {max(times):8.2f}"


def print_table(times: dict[str, list[float]], baseline: str, title: str) -> None:
  """Prints min / median / max ms and the median ratio to ``baseline``."""
  base = statistics.median(times[baseline])
  print(f"\n{title}")
  print(f"{'case':44s} {'min':>8s} {'median':>8s} {'max':>8s}  ratio (median / {baseline})")
  for name, ts in times.items():
    print(f"{name:44s} {summary(ts)}  {statistics.median(ts) / base:6.2f}")


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
  """``median(numerator) / median(denominator)``: e.g. a peer's times over ours."""
  return statistics.median(numerator) / statistics.median(denominator)


def size_tag(rows: int, width: int) -> str:
  """A table's size in a ratio's name: ``1M_x_64``, ``10M_x_32``, ``100k_x_64``, ``1000_x_8``."""
  for unit, suffix in ((1_000_000, "M"), (1_000, "k")):
    if rows >= unit and rows % unit == 0:
      return f"{rows // unit}{suffix}_x_{width}"
  return f"{rows}_x_{width}"


# -- the machine's state --------------------------------------------------------


def cpu_times() -> tuple[int, int] | None:
  """``(steal, total)`` jiffies of ``/proc/stat``'s ``cpu`` line; None without it."""
  try:
    with open("/proc/stat") as f:
      fields = f.readline().split()
  except OSError:
    return None
  if not fields or fields[0] != "cpu":
    return None
  # user nice system idle iowait irq softirq steal [guest guest_nice]: guest
  # time is already counted in user, so the total stops at steal.
  ticks = [int(x) for x in fields[1:9]]
  return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def steal_pct(before, after) -> float | None:
  """Steal time (%) between two ``cpu_times()``; None where either is missing."""
  if before is None or after is None or after[1] <= before[1]:
    return None
  return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


def last_level_cache_bytes() -> int:
  """The largest cache sysfs lists for CPU 0 (32 MiB where it lists none)."""
  sizes = []
  base = "/sys/devices/system/cpu/cpu0/cache"
  for index in sorted(os.listdir(base)) if os.path.isdir(base) else ():
    try:
      with open(os.path.join(base, index, "size")) as f:
        text = f.read().strip()
    except OSError:
      continue
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    sizes.append(int(text.rstrip("KMG")) * scale)
  return max(sizes, default=32 << 20)


def default_probe_bytes() -> int:
  low, high = PROBE_BYTES_RANGE
  return min(max(2 * last_level_cache_bytes(), low), high)


#: Seconds the probe waits before it copies: the benchmark's worker threads
#: (XLA's pool, OpenMP) spin for a while after a round, and a probe sharing the
#: cores with them measures the benchmark, not the machine.
PROBE_SETTLE_S = 0.25

#: The probe's process: per request, a pause (``PROBE_SETTLE_S``), two buffers
#: allocated and written (so no page is first touched while timed), copied
#: ``copies`` times, then freed.
_PROBE_CHILD = """
import statistics, sys, time
import numpy as np
n, copies, settle = int(sys.argv[1]) // 8, int(sys.argv[2]), float(sys.argv[3])
print("ready", flush=True)
for _ in sys.stdin:
  time.sleep(settle)
  src, dst = np.ones(n), np.full(n, 2.0)
  seconds = []
  for _ in range(copies):
    start = time.perf_counter()
    np.copyto(dst, src)
    seconds.append(time.perf_counter() - start)
  del src, dst
  print(2 * n * 8 / statistics.median(seconds) / 1e9, flush=True)
"""


class CopyProbe:
  """A memory-copy probe: ``probe()`` copies a buffer past the caches, returns GB/s.

  GB/s counts the bytes read and written (2x the buffer), the median of
  ``copies`` copies. The copies run in a process of their own, which holds
  the buffers only while it probes: the benchmark's own peak RSS, which
  several scripts print, does not count them, and a table-sized benchmark
  does not share the machine's memory with them between probes.
  """

  def __init__(self, nbytes: int, copies: int = 5, settle_s: float = PROBE_SETTLE_S):
    self.nbytes = max(nbytes // 8, 1) * 8
    self._child = subprocess.Popen(
        [sys.executable, "-c", _PROBE_CHILD, str(self.nbytes), str(copies), str(settle_s)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if self._child.stdout.readline().strip() != "ready":
      raise RuntimeError("the copy probe's process did not start (it needs numpy)")

  def __call__(self) -> float:
    self._child.stdin.write("probe\n")
    self._child.stdin.flush()
    return float(self._child.stdout.readline())

  def close(self) -> None:
    if self._child.poll() is None:
      self._child.stdin.close()
      self._child.wait()


def available_memory_bytes() -> int:
  """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 where there is none): what a
  benchmark's workers may still take without pushing others' pages out."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def spread(values: list[float]) -> float | None:
  """The 90th over the 10th percentile, less 1 (0.2: 20% apart); None under two values.

  Under ten values those are the fastest and the slowest. The tails are left
  out because the ratios are medians over rounds, which a probe's outlier
  (or one disturbed round) does not move, and the probe's own outliers put
  an idle machine's fastest-over-slowest past the rule (benchmarks/README.md).
  """
  if len(values) < 2 or min(values) <= 0:
    return None
  v = sorted(values)
  cut = (len(v) - 1) // 10
  return v[-1 - cut] / v[cut] - 1


def git_commit(root: str = ROOT) -> tuple[str, bool]:
  """``(short commit, dirty)`` of the checkout at ``root``; ``("unknown", True)`` outside git."""
  try:
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short=7", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    changed = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown", True
  return commit, bool(changed)


def quiet_reasons(record: dict) -> list[str]:
  """Why a run's record is not quiet (the module docstring's rules); empty when it is."""
  m = record["machine"]
  cores = m.get("cores") or 1
  reasons = []
  if m["load_before"] > QUIET_LOAD_PER_CORE * cores:
    reasons.append(f"load average {m['load_before']:.2f} at the start > "
                   f"{QUIET_LOAD_PER_CORE * cores:.2f} ({QUIET_LOAD_PER_CORE} x {cores} cores)")
  if m["steal_pct"] is None:
    reasons.append("no steal time (no /proc/stat)")
  elif m["steal_pct"] > QUIET_STEAL_PCT:
    reasons.append(f"steal {m['steal_pct']:.1f}% > {QUIET_STEAL_PCT:.0f}%")
  s = spread(m["copy_gbps"])
  if s is None:
    reasons.append("fewer than two copy probes")
  elif s > NOISY_SPREAD:
    reasons.append(f"copy probe spread {s:.0%} > {NOISY_SPREAD:.0%}")
  return reasons


def check_record(record: dict) -> None:
  """Raises ValueError naming the first key of the ``--json`` format a record lacks."""
  for key in KEYS:
    if key not in record:
      raise ValueError(f"the record has no {key!r}: a --json file holds {KEYS}")
  for key in MACHINE_KEYS:
    if key not in record["machine"]:
      raise ValueError(f"the record's machine has no {key!r}: it holds {MACHINE_KEYS}")
  for case in record["cases"]:
    missing = [k for k in CASE_KEYS if k not in case]
    if missing:
      raise ValueError(f"case {case.get('name')!r} has no {missing}: a case holds {CASE_KEYS}")


def add_json_argument(parser) -> None:
  """``--json FILE``: write the run's record (the module docstring) to FILE."""
  parser.add_argument("--json", metavar="FILE", default=None,
                      help="write the run's figures and machine state to FILE (JSON)")


def add_inner_argument(parser, since: str, default: int = 8) -> None:
  """``--inner N``: calls per timed sample, back to back (``time_calls``).

  ``since``: when the benchmark's default became ``default`` (its runs
  before timed one call a sample), for the help.
  """
  parser.add_argument("--inner", type=int, default=default, metavar="N",
                      help=f"calls per timed sample, back to back (default {default}; the runs "
                           f"before {since} timed 1)")


def check_inner(parser, inner: int) -> None:
  """Stops the parse with a message naming ``--inner`` unless it is at least 1."""
  if inner < 1:
    parser.error(f"--inner {inner}: a sample makes at least one call; pass 1 or more")


def _without_json(argv: list[str]) -> list[str]:
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a == "--json":
      skip = True
    elif not a.startswith("--json="):
      out.append(a)
  return out


class Run:
  """One run's record: the machine's state beside its cases and ratios.

  Creating it reads the load average and ``/proc/stat`` and takes the first
  copy probe; call ``probe`` after every round, ``add_times`` / ``add_case``
  and ``ratio`` as figures come, and ``finish`` once at the end.

  Args:
    benchmark: the script's name (``sparse_step``).
    argv: its arguments (``sys.argv[1:]`` when None), for ``command``.
    smoke: the run took the script's smoke sizes.
    probe_bytes: the probe's buffer (default: ``default_probe_bytes``;
      ``SMOKE_PROBE_BYTES`` when ``smoke``).
  """

  def __init__(self, benchmark: str, argv=None, *, smoke: bool = False,
               probe_bytes: int | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    self.benchmark, self.smoke = benchmark, bool(smoke)
    self.command = shlex.join(["python3", f"benchmarks/{benchmark}.py", *_without_json(argv)])
    self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    self.commit, self.dirty = git_commit()
    self.load_before = os.getloadavg()[0]
    self._cpu_before = cpu_times()
    if probe_bytes is None:
      probe_bytes = SMOKE_PROBE_BYTES if smoke else default_probe_bytes()
    self._probe = CopyProbe(probe_bytes)
    self.copy_gbps: list[float] = []
    self.cases: list[dict] = []
    self.ratios: dict[str, float] = {}
    self.notes: list[str] = []
    self.probe()

  def probe(self) -> None:
    """One memory-copy probe, now (between rounds)."""
    self.copy_gbps.append(self._probe())

  def add_case(self, name: str, values, unit: str = "ms") -> None:
    """A case's figures: one value or several (min / median / max over them)."""
    values = [float(v) for v in (values if isinstance(values, (list, tuple)) else [values])]
    if any(c["name"] == name for c in self.cases):
      raise ValueError(f"case {name!r} recorded twice: give each table's cases a prefix")
    self.cases.append({"name": name, "min": min(values), "median": statistics.median(values),
                       "max": max(values), "unit": unit, "n": len(values)})

  def add_times(self, times: dict, unit: str = "ms", prefix: str = "") -> None:
    """Every case of a ``name -> [values]`` dict, named ``prefix + name``."""
    for name, values in times.items():
      self.add_case(prefix + name, values, unit)

  def ratio(self, name: str, value: float) -> None:
    """A named ratio (``vs_fbgemm_1M_x_64``), printed and kept beside the machine's state."""
    self.ratios[name] = float(value)

  def note(self, text: str) -> None:
    """A remark kept with the record (a skipped peer column, a run not interleaved)."""
    self.notes.append(text)

  def record(self) -> dict:
    """The record as ``--json`` writes it (the load after and steal: as of now)."""
    gbps = [round(g, 3) for g in self.copy_gbps]
    machine = {
        "cores": os.cpu_count(),
        "load_before": self.load_before,
        "load_after": os.getloadavg()[0],
        "steal_pct": steal_pct(self._cpu_before, cpu_times()),
        "copy_gbps": gbps,
        "copy_spread": spread(gbps),
        "probe_mib": self._probe.nbytes / (1 << 20),
    }
    out = {"benchmark": self.benchmark, "commit": self.commit, "dirty": self.dirty,
           "date": self.date, "command": self.command, "smoke": self.smoke,
           "machine": machine, "cases": self.cases, "ratios": self.ratios}
    s = machine["copy_spread"]
    out["noisy"] = s is not None and s > NOISY_SPREAD
    out["not_quiet_because"] = quiet_reasons(out)
    out["quiet"] = not out["not_quiet_because"]
    out["notes"] = self.notes
    return out

  def finish(self, path: str | None = None) -> dict:
    """Probes once more if needed, prints the machine and the ratios, writes ``path``."""
    if len(self.copy_gbps) < 2:
      self.probe()
    self._probe.close()
    out = self.record()
    print_record(out)
    if path:
      with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
      print(f"record: wrote {path}")
    return out


def print_record(record: dict) -> None:
  """The machine's state, the ratios with a noisy run's flag beside them, the verdict."""
  m = record["machine"]
  g = m["copy_gbps"]
  steal = "unknown" if m["steal_pct"] is None else f"{m['steal_pct']:.1f}%"
  s = m["copy_spread"]
  print(f"\nrun: {record['benchmark']} at {record['commit']}"
        f"{' (uncommitted changes)' if record['dirty'] else ''}, {record['date']}; "
        f"{record['command']}")
  print(f"machine: {m['cores']} cores, load average {m['load_before']:.2f} before and "
        f"{m['load_after']:.2f} after; steal {steal}; copy probe {min(g):.1f} / "
        f"{statistics.median(g):.1f} / {max(g):.1f} GB/s over {len(g)} probes"
        + (f" (spread {s:.0%})" if s is not None else ""))
  flag = (f"  NOISY: the copy probe varied {s:.0%} between rounds (> {NOISY_SPREAD:.0%})"
          if record["noisy"] else "")
  if record["ratios"]:
    print("ratios:" + flag)
    for name, value in record["ratios"].items():
      print(f"  {name:40s} {value:8.3f}" + ("  (noisy)" if record["noisy"] else ""))
  elif flag:
    print(flag.strip())
  for note in record["notes"]:
    print(f"note: {note}")
  verdict = "quiet" if record["quiet"] else "not quiet: " + "; ".join(record["not_quiet_because"])
  print(f"this run: {verdict}" + (" (smoke sizes: not a headline run)" if record["smoke"] else ""))
