"""Your own logs at scale: the tabular reader's examples/s and peak RSS on a 20M-row Parquet log.

    python3 benchmarks/tabular_scale.py                   # 20M rows in 50 files, cached in /tmp
    python3 benchmarks/tabular_scale.py --data-dir DIR --rows 40000000 --files 100
    python3 benchmarks/tabular_scale.py --rss-files 10,25,50 --workers 0,1,2
    python3 benchmarks/tabular_scale.py --quick           # a smoke run

The log is ``embedlib.tabular.synth``'s planted click log (string user ids,
int item ids, a list column of categories, ``price`` and five dense
columns ``d0 .. d4`` with nulls, ``hour``, ``device``, ``clicked``),
written once into ``--data-dir`` (outside the repository; reused while its
``DONE`` marker is there): ``--rows`` rows in ``--files`` Parquet files,
row groups of ``--row-group`` rows. Label ``clicked``; the hash split of
``configs/tabular.py`` (eval 10%, test 10%).

Three parts:

1. Memory (``--rss-files``): for each count N, a fresh process reads the
   first N files: ``tabular.prepare`` (the statistics pass over the
   training rows; every row read and checked), then one pass of
   ``TabularSource`` over the training rows, shuffled, in this process
   (no workers). It reports its peak RSS (``VmHWM``) after the imports,
   after the statistics pass and after the read, and the times of both
   passes. Flat peaks over N say memory does not grow with the dataset;
   the peak beside one file's and one row group's decoded size
   (uncompressed Arrow bytes, from the Parquet metadata) says whether a
   whole file is ever held.
2. Rates (``--workers``): ``TabularSource`` over the training rows of
   every file (shuffled, endless, featurized batches of ``--batch-size``),
   in this process (0) and with 1 and 2 grain workers; beside it, the
   binary Criteo reader (``embedlib.data.criteo_binary``, memory-mapped
   records of a ``criteo_synth`` file, as ``benchmarks/input_pipeline.py``)
   and a DLRM training step on this log's schema (``configs/tabular.py``'s
   model, ``train_step`` on one featurized batch, one CPU device).
   Every case is started and warmed up first; then each reads
   ``--window`` examples per repeat, round-robin, ``--repeats`` times. A
   case with workers first reads what its workers made ahead while the
   other cases ran (their buffers), so a window times reading, not a full
   buffer. Examples/s min / median / max, ratios of medians to the binary
   Criteo reader and to the DLRM step, and CPU ms per 1,000 examples (this
   process; this process and its workers).
3. The statistics pass over every file: its time and rows/s, from the
   largest memory run.

The machine's 1-minute load average is printed before and after each
part: on a shared machine the rates depend on it (the CPU times less so).
Never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "peers"))
sys.path.insert(2, ROOT)

from worker_protocol import peak_rss_mib  # noqa: E402

import timing  # noqa: E402

RESULT = "@@result "
LABEL = "clicked"
CRITEO = "binary Criteo reader"
STEP = "DLRM step (tabular schema)"


def rss_mib() -> float:
  """This process's resident set size now (``VmRSS``), MiB."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def peak_of(pid: int) -> float:
  """Peak RSS (``VmHWM``) of process ``pid``, MiB; NaN if it is gone."""
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return float("nan")


# -- the log ----------------------------------------------------------------------------


def ensure_log(data_dir: str, rows: int, files: int, row_group: int) -> str:
  """The log's directory under ``data_dir``, written first if no complete copy is there."""
  from embedlib.tabular import synth  # pylint: disable=g-import-not-at-top

  folder = os.path.join(data_dir, f"synth-rows{rows}-files{files}-seed0"
                        + ("" if row_group == 65_536 else f"-rg{row_group}"))
  done = os.path.join(folder, "DONE")
  if os.path.exists(done):
    return folder
  print(f"writing the log: {rows:,} rows in {files} Parquet files under {folder} ...",
        flush=True)
  tic = time.perf_counter()
  synth.write(folder, rows_total=rows, files=files, row_group=row_group)
  with open(done, "w") as f:
    f.write(f"{time.perf_counter() - tic:.1f}\n")
  return folder


def parquet_files(folder: str) -> list[str]:
  return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".parquet"))


def first_files(folder: str, n: int, out_root: str) -> str:
  """A directory of links to the log's first ``n`` files."""
  target = os.path.join(out_root, f"first{n}")
  os.makedirs(target, exist_ok=True)
  for path in parquet_files(folder)[:n]:
    link = os.path.join(target, os.path.basename(path))
    if not os.path.exists(link):
      os.symlink(path, link)
  return target


def decoded_sizes(folder: str) -> dict:
  """The log's files, rows and row groups, and the first file's size in Arrow's memory.

  ``file_mib``: the whole first file read as one Arrow table (``nbytes``);
  ``row_group_mib``: its first row group. Parquet's own "uncompressed"
  sizes are of its encoded pages (dictionaries, run lengths), well under
  what a reader holds.
  """
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  paths = parquet_files(folder)
  rows = groups = 0
  for path in paths:
    meta = pq.ParquetFile(path).metadata
    rows += meta.num_rows
    groups += meta.num_row_groups
  first = pq.ParquetFile(paths[0])
  return {"file_mib": first.read().nbytes / 2**20,
          "row_group_mib": first.read_row_group(0).nbytes / 2**20,
          "file_rows": first.metadata.num_rows, "row_group_rows": first.metadata.row_group(0).num_rows,
          "files": len(paths), "rows": rows, "row_groups": groups}


def hints():
  from embedlib import tabular  # pylint: disable=g-import-not-at-top

  return tabular.Hints(labels=(LABEL,))


def split():
  """configs/tabular.py's split."""
  from configs import tabular as tabular_config  # pylint: disable=g-import-not-at-top
  from embedlib import tabular  # pylint: disable=g-import-not-at-top

  data = tabular_config.get_config().data
  return tabular.Split(data.split, eval_fraction=data.eval_fraction,
                       test_fraction=data.test_fraction, seed=data.split_seed)


# -- 1. memory: a fresh process per file count ----------------------------------------------


def memory_worker(args) -> None:
  """Prepares and reads ``args.path`` once, in this process; prints the ``@@result`` line."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top

  from embedlib import tabular  # pylint: disable=g-import-not-at-top

  the_hints, the_split = hints(), split()  # every import done
  base = peak_rss_mib()
  tic, cpu = time.perf_counter(), time.process_time()
  data = tabular.prepare(args.path, the_hints, split=the_split)
  prepare_s, prepare_cpu_s = time.perf_counter() - tic, time.process_time() - cpu
  after_prepare = peak_rss_mib()
  pool = pa.default_memory_pool()
  arrow_prepare = (pool.max_memory() / 2**20, pool.bytes_allocated() / 2**20)
  if args.save:
    tabular.saved.save(args.save, data.schema, data.statistics)
  rows = int(json.loads(data.statistics)["rows"])
  source = data.source("train", batch_size=args.batch_size, shuffle=True, num_epochs=1)
  tic, cpu, read = time.perf_counter(), time.process_time(), 0
  for batch in source:
    read += len(batch["label"])
  read_s, read_cpu_s = time.perf_counter() - tic, time.process_time() - cpu
  print(RESULT + json.dumps({
      "files": len(data.files.paths), "train_rows": rows, "read_examples": read,
      # Arrow's memory (decoded columns, tables, the vocabularies' arrays) in this process:
      # the most held at once, by the end of the statistics pass and by the end of the read,
      # and what stays held after the statistics pass.
      "arrow_peak_prepare_mib": arrow_prepare[0], "arrow_held_after_prepare_mib": arrow_prepare[1],
      "arrow_peak_mib": pool.max_memory() / 2**20, "arrow_pool": pool.backend_name,
      "prepare_s": prepare_s, "read_s": read_s, "prepare_cpu_s": prepare_cpu_s,
      "read_cpu_s": read_cpu_s, "rss_imports_mib": base,
      "peak_after_prepare_mib": after_prepare, "peak_mib": peak_rss_mib(),
      "rss_end_mib": rss_mib(),
  }), flush=True)


def run_memory(path: str, batch_size: int, save: str | None = None) -> dict:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep), JAX_PLATFORMS="cpu")
  argv = [sys.executable, os.path.abspath(__file__), "--memory-worker", "--path", path,
          "--batch-size", str(batch_size)] + (["--save", save] if save else [])
  load = os.getloadavg()[0]
  proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
  if proc.returncode or not lines:
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-20:])
    raise RuntimeError(f"the memory run of {path} failed (exit {proc.returncode}):\n{tail}")
  return dict(json.loads(lines[-1][len(RESULT):]), load_before=load,
              load_after=os.getloadavg()[0])


def print_memory(runs: list[dict], sizes: dict) -> None:
  print(f"\nMemory: each row a fresh process reading the first N files (statistics pass, then "
        f"one shuffled pass over the training rows, no workers)")
  print(f"{'files':>5} {'train rows':>11} {'prepare s':>9} {'rows/s':>9} {'/ CPU s':>9} "
        f"{'read s':>7} {'ex/s':>9} {'/ CPU s':>9} {'RSS MiB: imports':>16} {'after prepare':>13} {'peak':>7} "
        f"{'peak - imports':>14} {'Arrow: held':>11} {'peak':>6} {'load':>9}")
  for r in runs:
    rows = r["train_rows"] / 0.8
    print(f"{r['files']:>5} {r['train_rows']:>11,} {r['prepare_s']:>9.1f} "
          f"{rows / r['prepare_s']:>9,.0f} {rows / r['prepare_cpu_s']:>9,.0f} {r['read_s']:>7.1f} "
          f"{r['read_examples'] / r['read_s']:>9,.0f} {r['read_examples'] / r['read_cpu_s']:>9,.0f} "
          f"{r['rss_imports_mib']:>16.0f} "
          f"{r['peak_after_prepare_mib']:>13.0f} {r['peak_mib']:>7.0f} "
          f"{r['peak_mib'] - r['rss_imports_mib']:>14.0f} "
          f"{r['arrow_held_after_prepare_mib']:>11.1f} {r['arrow_peak_mib']:>6.1f} "
          f"{r['load_before']:>4.1f}-{r['load_after']:<4.1f}")
  print(f"  one file in Arrow's memory: {sizes['file_mib']:.1f} MiB ({sizes['file_rows']:,} rows); "
        f"one row group: {sizes['row_group_mib']:.1f} MiB ({sizes['row_group_rows']:,} rows). "
        "Arrow: its memory pool "
        f"({runs[0]['arrow_pool'] if runs else '-'}): held after the statistics pass "
        "(vocabularies), and the most held at once (decoded chunks on top). rows/s: of "
        "the statistics pass, every row read (train rows / 0.8); / CPU s: per CPU second of "
        "the process (what the load leaves out)")


# -- 2. rates ----------------------------------------------------------------------------


def _cpu(processes) -> float:
  """CPU seconds of ``processes``: this one's to the clock's resolution, others' by psutil."""
  import psutil  # pylint: disable=g-import-not-at-top

  total = 0.0
  for process in processes:
    if process.pid == os.getpid():
      total += time.process_time()
      continue
    try:
      total += sum(process.cpu_times()[:2])
    except psutil.NoSuchProcess:
      pass
  return total


def criteo_reader(tmp: str, lines: int, batch_size: int):
  """A ``CriteoBinaryReader`` of a ``criteo_synth`` file of ``lines`` lines (written here)."""
  from embedlib.data import criteo_binary, criteo_spec  # pylint: disable=g-import-not-at-top
  from embedlib.data.criteo_synth import CriteoSynth  # pylint: disable=g-import-not-at-top

  tables = [1_000_000] * 26
  path = os.path.join(tmp, "day.tsv")
  CriteoSynth().write(path, lines)
  criteo_binary.convert([path], os.path.join(tmp, "bin"), table_sizes=tables)
  return criteo_binary.CriteoBinaryReader(os.path.join(tmp, "bin"), criteo_spec(tables),
                                          batch_size=batch_size, num_epochs=None)


def dlrm_step(path: str, saved: str, batch, batch_size: int, quick: bool):
  """``step()``: one ``train_step`` of configs/tabular.py's DLRM on this log's schema."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from configs import tabular as tabular_config  # pylint: disable=g-import-not-at-top
  from embedlib import data as data_lib  # pylint: disable=g-import-not-at-top
  from embedlib.training import setup, train_lib  # pylint: disable=g-import-not-at-top

  config = tabular_config.get_config(f"smoke,{path}" if quick else path)
  config.data.label = LABEL
  config.batch_size = batch_size
  task = setup.task(config).for_workdir(saved)  # the saved schema: no statistics pass
  setup.resolve_epochs(config, task)  # the schedule's steps, as a run of the config sets them
  mesh = setup.make_mesh(config)
  model, optimizer = setup.model_and_optimizer(config, task, task.data_spec(), mesh)
  step = nnx.cached_partial(train_lib.train_step, model, optimizer)
  global_batch = data_lib.to_global_batch(task.featurize(batch), mesh)

  def run():
    return jax.block_until_ready(step(global_batch, task=task))

  return run


def measure_rates(args, log_dir: str, saved: str, tmp: str) -> tuple[dict, dict]:
  """``({case: {"ex_s", "cpu_here", "cpu_all": [per repeat]}}, {process: [peak RSS MiB]})``.

  The second: each worker case's workers' peak RSS, and this process's (module docstring).
  """
  import psutil  # pylint: disable=g-import-not-at-top

  from embedlib import tabular  # pylint: disable=g-import-not-at-top
  from embedlib.tabular import source as source_lib  # pylint: disable=g-import-not-at-top

  data = tabular.prepare(log_dir, saved=saved, split=split())
  batch_size = args.batch_size
  kept = int(args.row_group * 0.8)  # training rows of a chunk
  me = psutil.Process()
  cases = {}  # name -> (next_batch, examples a window, examples to read first, processes)
  started = {}
  for w in args.workers:
    tic = time.perf_counter()
    before = {p.pid for p in me.children(recursive=True)}
    reader = data.source("train", batch_size=batch_size, shuffle=True, workers=w)
    next(reader)
    started[w] = time.perf_counter() - tic
    # What a worker holds ready after a pause: its buffer, grain's queue, the one in hand.
    ahead = w * (source_lib.BUFFER_CHUNKS + 4) * kept
    name = "tabular, in-process" if w == 0 else f"tabular, {w} worker{'s' * (w > 1)}"
    cases[name] = (reader.__next__, args.window, ahead,
                   [me] + [p for p in me.children(recursive=True) if p.pid not in before])
  criteo = criteo_reader(tmp, args.criteo_lines, batch_size)
  next(criteo)
  cases[CRITEO] = (criteo.__next__, 20 * args.window, 0, [me])
  if not args.no_step:
    batch = next(data.source("train", batch_size=batch_size, num_epochs=1))
    step = dlrm_step(log_dir, saved, batch, batch_size, args.quick)
    step()  # compiled
    step()
    cases[STEP] = (step, max(args.window // 8, batch_size), 0, [me])
  print("started: " + ", ".join(f"{w} worker(s) first batch after {s:.1f} s"
                                for w, s in started.items()), flush=True)
  out = {name: {"ex_s": [], "cpu_here": [], "cpu_all": []} for name in cases}
  for _ in range(args.repeats):
    for name, (next_batch, examples, ahead, processes) in cases.items():
      for _ in range(-(-ahead // batch_size)):
        next_batch()
      before = (time.process_time(), _cpu(processes))
      tic = time.perf_counter()
      calls = -(-examples // batch_size)
      for _ in range(calls):
        next_batch()
      seconds = time.perf_counter() - tic
      done = calls * batch_size
      out[name]["ex_s"].append(done / seconds)
      out[name]["cpu_here"].append((time.process_time() - before[0]) / done * 1e6)
      out[name]["cpu_all"].append((_cpu(processes) - before[1]) / done * 1e6)
      time.sleep(args.settle)  # a case's workers refill before the next case is timed
  peaks = {name: [peak_of(p.pid) for p in processes if p.pid != me.pid]
           for name, (_, _, _, processes) in cases.items()}
  peaks = {name: v for name, v in peaks.items() if v}
  peaks["the reading process (every case, the step's model)"] = [peak_rss_mib()]
  return out, peaks


def spread(values) -> dict:
  return {"min": min(values), "median": statistics.median(values), "max": max(values),
          "values": list(values)}


def rate_ratios(rates: dict) -> dict:
  """Named ratios of median examples/s: each tabular case to the Criteo reader and the step."""
  med = {name: statistics.median(r["ex_s"]) for name, r in rates.items()}
  cpu = {name: statistics.median(r["cpu_all"]) for name, r in rates.items() if "cpu_all" in r}
  out = {}
  for name in med:
    if name.startswith("tabular"):
      if CRITEO in med:
        out[f"{name} / {CRITEO}"] = med[name] / med[CRITEO]
      if STEP in med:
        out[f"{name} / {STEP}"] = med[name] / med[STEP]
  base = "tabular, in-process"
  for name in med:
    if name.startswith("tabular") and name != base and base in med:
      out[f"{name} / {base}"] = med[name] / med[base]
  for name in cpu:  # the load shares CPU out; a case's CPU per example it does not
    if name.startswith("tabular") and STEP in cpu and cpu[name] > 0:
      out[f"CPU per example: {STEP} / {name}"] = cpu[STEP] / cpu[name]
  return out


def print_rates(rates: dict, named: dict, batch_size: int, load: tuple) -> None:
  print(f"\nRates: examples/s at batch {batch_size:,} (min / median / max over the repeats), "
        f"load {load[0]:.1f} -> {load[1]:.1f}")
  print(f"{'case':30s} {'min':>11s} {'median':>11s} {'max':>11s}  "
        f"{'CPU ms / 1k examples: here':>26s}  {'all':>6s}")
  for name, r in rates.items():
    v = r["ex_s"]
    print(f"{name:30s} {min(v):11,.0f} {statistics.median(v):11,.0f} {max(v):11,.0f}  "
          f"{statistics.median(r['cpu_here']):26.3f}  {statistics.median(r['cpu_all']):6.3f}")
  print("ratios of medians (CPU per example: of the CPU time each spends on an example, this "
        "process and its workers; above 1, the reader costs less than the step):")
  for k, v in named.items():
    print(f"  {k}: {v:.3f}")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(),
                                                         "embedlib_tabular_scale"))
  parser.add_argument("--rows", type=int, default=20_000_000)
  parser.add_argument("--files", type=int, default=50)
  parser.add_argument("--row-group", type=int, default=65_536)
  parser.add_argument("--rss-files", default="10,25,50",
                      help="file counts of the memory runs ('none': skip them)")
  parser.add_argument("--workers", default="0,1,2", help="comma-separated worker counts")
  parser.add_argument("--batch-size", type=int, default=4096)
  parser.add_argument("--window", type=int, default=262_144, help="examples per repeat")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--settle", type=float, default=0.5)
  parser.add_argument("--criteo-lines", type=int, default=100_352)
  parser.add_argument("--no-step", action="store_true", help="leave out the DLRM step")
  parser.add_argument("--out", default=None, help="write the results here (JSON)")
  timing.add_json_argument(parser)
  parser.add_argument("--quick", action="store_true", help="a tiny log: a smoke run")
  parser.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--path", help=argparse.SUPPRESS)
  parser.add_argument("--save", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.memory_worker:
    return memory_worker(args)
  if "jax" not in sys.modules:  # the DLRM step on one CPU device, as --cpu_devices=1
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  if args.quick:
    args.rows, args.files, args.row_group = 24_000, 3, 2_000
    args.rss_files = "1,3" if args.rss_files == "10,25,50" else args.rss_files
    args.batch_size, args.window, args.repeats, args.settle = 256, 2_048, 1, 0.0
    args.criteo_lines = 4_096
  args.workers = [int(w) for w in args.workers.split(",") if w]
  counts = [int(n) for n in args.rss_files.split(",") if n and n != "none"]
  counts = sorted({min(n, args.files) for n in counts})

  run = timing.Run("tabular_scale", argv, smoke=args.quick)
  print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}", flush=True)
  log_dir = ensure_log(args.data_dir, args.rows, args.files, args.row_group)
  sizes = decoded_sizes(log_dir)
  print(f"log: {log_dir}: {sizes['rows']:,} rows in {sizes['files']} files, "
        f"{sizes['row_groups']} row groups", flush=True)
  results = {"benchmark": "tabular_scale", "log": log_dir, "sizes": sizes,
             "batch_size": args.batch_size, "quick": args.quick}
  with tempfile.TemporaryDirectory(prefix="tabular_scale_") as tmp:
    saved = os.path.join(tmp, "saved")
    os.makedirs(saved)
    memory = []
    for n in counts:
      whole = n == sizes["files"]
      path = log_dir if whole else first_files(log_dir, n, tmp)
      memory.append(run_memory(path, args.batch_size, saved if whole else None))
      print(f"  {n} files: peak RSS {memory[-1]['peak_mib']:.0f} MiB", flush=True)
      run.add_case(f"peak RSS, {n} files", memory[-1]["peak_mib"], unit="MiB")
      run.probe()
    if memory:
      print_memory(memory, sizes)
    results["memory"] = memory
    if not os.path.exists(os.path.join(saved, "schema.json")):  # no memory run read them all
      from embedlib import tabular  # pylint: disable=g-import-not-at-top

      tic = time.perf_counter()
      data = tabular.prepare(log_dir, hints(), split=split())
      tabular.saved.save(saved, data.schema, data.statistics)
      results["prepare_s"] = time.perf_counter() - tic
    else:
      results["prepare_s"] = memory[-1]["prepare_s"]
    print(f"\nstatistics pass over all {sizes['files']} files ({sizes['rows']:,} rows): "
          f"{results['prepare_s']:.1f} s, {sizes['rows'] / results['prepare_s']:,.0f} rows/s",
          flush=True)
    if args.workers or not args.no_step:
      load = os.getloadavg()[0]
      rates, peaks = measure_rates(args, log_dir, saved, tmp)
      load = (load, os.getloadavg()[0])
      named = rate_ratios(rates)
      print_rates(rates, named, args.batch_size, load)
      print("peak RSS MiB: " + "; ".join(
          f"{name}: {', '.join(f'{v:.0f}' for v in values)}" for name, values in peaks.items()))
      results["peak_rss_mib"] = peaks
      run.add_times({k: v["ex_s"] for k, v in rates.items()}, unit="examples/s")
      for name, value in named.items():
        run.ratio(name, value)
      results.update(cases={k: {"ex_s": spread(v["ex_s"]),
                                "cpu_ms_per_1k_here": statistics.median(v["cpu_here"]),
                                "cpu_ms_per_1k_all": statistics.median(v["cpu_all"])}
                            for k, v in rates.items()},
                     ratios=named, load=load)
  run.add_case("statistics pass", results["prepare_s"], unit="s")
  run.finish(args.json)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
