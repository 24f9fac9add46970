"""Host memory of a Criteo-config training run: evals, checkpoints and a restore.

    python3 benchmarks/train_memory.py                    # 26 x 200k x 64 (1.3 GB of tables)
    python3 benchmarks/train_memory.py --rows 1000000     # the config's size (6.7 GB; ~9 GB RSS)
    python3 benchmarks/train_memory.py --quick            # tiny tables, a smoke run
    python3 benchmarks/train_memory.py --raw-ids          # dynamic tables read raw ids
    python3 benchmarks/train_memory.py --json run.json    # also the run's record (timing.Run)

Writes a Criteo-format file (``embedlib.data.criteo_synth``), then runs
``python -m train --config configs/dlrm_criteo.py:FILE`` on 8 simulated CPU
devices (whose buffers are this machine's memory) twice in one workdir: a
first run of ``--steps`` steps with an eval and a checkpoint every
``--every``, then a rerun with ``--every`` more steps that restores the last
checkpoint, evaluates and saves again. The trainer's resident set
(``VmRSS``) is sampled from ``/proc`` throughout beside
the trainer's log lines' times.

The same two runs with 1,000-row tables first give the process constant
(imports, jax, the compiled programs, orbax, the data pipeline: their peak
less their tiny state). Printed, per run: the RSS after imports (before the
model is built), the peak, and the highest RSS of each stretch of ``--every``
steps (each after the first holds an eval and a checkpoint); all against the
tables' and optimizer slots' bytes ("state"). Target: ``peak - constant <=
1.3 x state``, and the stretches flat from the second eval on (their spread
is printed).

``--raw-ids`` trains the same tables as dynamic ones (``config.data.raw_ids``,
``embedlib.DynamicEmbed`` of ``--rows`` rows each, LRU): the file's raw
values, unhashed, are admitted and evicted, and the state adds each table's
id -> row map (``Policy.map_bytes_per_row``) to its rows and slots.

``--json FILE`` keeps the run's record (``benchmarks/timing.py``): each
run's RSS after imports, peak and per-stretch highs (GB), and the named
ratios ``<run>_peak_less_constant_over_state`` (the target's) and
``<run>_peak_less_imports_over_state`` (``training`` and ``rerun``),
beside the machine's state (a copy probe after each trainer run).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import timing  # noqa: E402
NUM_TABLES, FEATURES = 26, 64
#: Rows of the baseline's tables: small enough that what it holds is the process constant.
BASELINE_ROWS = 1_000
#: Rows of 8 devices' whole buckets (``config.model.dynamic.bucket_size``'s default of 128).
WHOLE_BUCKETS = 8 * 128


def _rss(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def _env():
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", "")).strip()
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
              XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip())


def run_trainer(data: str, workdir: str, args, steps: int, interval: float = 0.05) -> dict:
  """Runs the trainer; ``{"samples": [(s, RSS)], "log": [(s, line)], "base": RSS}``."""
  overrides = [
      "--config.data.table_sizes=(" + ",".join([str(args.rows)] * NUM_TABLES) + ")",
      f"--config.batch_size={args.batch}", f"--config.num_train_steps={steps}",
      f"--config.eval_every={args.every}", f"--config.checkpoint_every={args.every}",
      f"--config.eval_batches={args.eval_batches}", f"--config.log_every={args.every}",
  ]
  if args.raw_ids:
    overrides += ["--config.data.raw_ids=True", "--config.model.dynamic.capacity=0"]
  cmd = [sys.executable, "-m", "train", f"--config=configs/dlrm_criteo.py:{data}",
         f"--workdir={workdir}", *overrides]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True)
  state = {"log": [], "base": None}
  start = time.perf_counter()

  def read_log():
    for line in proc.stderr:
      state["log"].append((time.perf_counter() - start, line))
      if "building the model" in line:
        state["base"] = _rss(proc.pid)
  reader = threading.Thread(target=read_log, daemon=True)
  reader.start()
  samples = []
  while proc.poll() is None:
    samples.append((time.perf_counter() - start, _rss(proc.pid)))
    time.sleep(interval)
  reader.join()
  if proc.returncode:
    tail = "".join(line for _, line in state["log"][-30:])
    raise RuntimeError(f"the trainer exited {proc.returncode}:\n{tail}")
  return {"samples": samples, "base": state["base"], "log": state["log"]}


def _highs(run) -> list[tuple[str, int]]:
  """The highest RSS in each stretch that ends at a logged step: ``[(label, bytes)]``.

  Steps are logged every ``--every``, just before that step's eval and
  checkpoint, so each stretch after the first holds an eval and a checkpoint.
  """
  marks = [(t, m.group(1)) for t, line in run["log"]
           for m in [re.search(r"\bstep (\d+) ", line)] if m and "loss" in line]
  marks.append((float("inf"), "end"))
  out, i = [], 0
  for label_start, (stop, label) in zip([None] + [m[1] for m in marks], marks):
    high = 0
    while i < len(run["samples"]) and run["samples"][i][0] < stop:
      high = max(high, run["samples"][i][1])
      i += 1
    out.append((f"to step {label}" if label_start is None else f"after step {label_start}", high))
  return out


def report(name: str, run: dict, state_bytes: int, constant: int | None = None,
           record=None, tag: str = "") -> dict:
  """Prints a run's figures (kept by ``record`` under ``tag``); ``constant``: the
  tiny-table baseline's process constant."""
  peak = max(r for _, r in run["samples"])
  base = run["base"] or 0
  g = 1e9
  if record is not None:
    record.add_case(f"{tag}: RSS after imports", base / g, "GB")
    record.add_case(f"{tag}: peak RSS", peak / g, "GB")
    record.add_case(f"{tag}: highest RSS per stretch", [h / g for _, h in _highs(run)], "GB")
    record.ratio(f"{tag}_peak_less_imports_over_state", (peak - base) / state_bytes)
    if constant is not None:
      record.ratio(f"{tag}_peak_less_constant_over_state", (peak - constant) / state_bytes)
  print(f"{name}: RSS after imports {base / g:.2f} GB; peak {peak / g:.2f} GB; "
        f"(peak - after imports) / state = {(peak - base) / state_bytes:.2f}")
  if constant is not None:
    print(f"  (peak - process constant {constant / g:.2f} GB) / state = "
          f"{(peak - constant) / state_bytes:.2f} (target <= 1.3)")
  highs = _highs(run)
  print("  highest RSS per stretch, GB (x - after imports) / state: " + "; ".join(
      f"{label} {h / g:.2f} ({(h - base) / state_bytes:.2f})" for label, h in highs))
  later = [h for label, h in highs[2:]]  # from the second eval on
  if len(later) > 1:
    print(f"  from the second eval on: spread {(max(later) - min(later)) / g:.3f} GB "
          f"= {(max(later) - min(later)) / state_bytes:.3f} x state")
  return {"peak": peak, "base": base}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=200_000, help="rows of each of the 26 tables")
  parser.add_argument("--lines", type=int, default=50_000, help="lines of the generated file")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--every", type=int, default=40, help="steps between evals/checkpoints")
  parser.add_argument("--batch", type=int, default=512)
  parser.add_argument("--eval-batches", type=int, default=5)
  parser.add_argument("--quick", action="store_true", help="tiny tables, a smoke run")
  parser.add_argument("--raw-ids", action="store_true",
                      help="dynamic tables of --rows rows read the file's raw ids")
  parser.add_argument("--keep", help="a directory to keep the data and workdir in")
  parser.add_argument("--trace", help="write every RSS sample (seconds, bytes, phase) here")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  record = timing.Run("train_memory", argv, smoke=args.quick)
  if args.quick:
    args.rows, args.lines, args.steps, args.every, args.batch = 2_000, 3_000, 8, 4, 64
    args.eval_batches = 2
  sys.path.insert(0, ROOT)
  from embedlib.data.criteo_synth import CriteoSynth  # pylint: disable=g-import-not-at-top

  tmp = args.keep or tempfile.mkdtemp(prefix="train_memory_")
  os.makedirs(tmp, exist_ok=True)
  data, workdir = os.path.join(tmp, "day.tsv"), os.path.join(tmp, "run")
  if not os.path.exists(data):
    CriteoSynth(seed=0).write(data, args.lines)
  map_bytes = 0
  if args.raw_ids:
    from embedlib.dynamic.policy import Policy  # pylint: disable=g-import-not-at-top

    # Devices own whole buckets: rows a multiple of 8 devices' buckets of 128.
    args.rows = -(-args.rows // WHOLE_BUCKETS) * WHOLE_BUCKETS
    map_bytes = Policy(WHOLE_BUCKETS).map_bytes_per_row()  # the config's default policy
  # Rows, row-wise AdaGrad's slot and, for dynamic tables, the id -> row map.
  state = lambda rows: int(NUM_TABLES * rows * ((FEATURES + 1) * 4 + map_bytes))
  kind = "dynamic tables (raw ids)" if args.raw_ids else "tables"
  print(f"26 {kind} of {args.rows:,} x {FEATURES} f32, their row-wise AdaGrad slots"
        f"{' and maps' if args.raw_ids else ''}: "
        f"{state(args.rows) / 1e9:.2f} GB ('state'); {args.steps} steps of {args.batch}, eval "
        f"({args.eval_batches} batches) and checkpoint every {args.every}; 8 CPU devices")
  runs = []
  constant = None
  baseline = WHOLE_BUCKETS if args.raw_ids else BASELINE_ROWS
  for rows in ([] if args.quick else [baseline]) + [args.rows]:
    label = "baseline" if rows == baseline and not args.quick else "run"
    tiny = argparse.Namespace(**{**vars(args), "rows": rows})
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh run, then its rerun
    first = run_trainer(data, workdir, tiny, args.steps)
    record.probe()
    second = run_trainer(data, workdir, tiny, args.steps + args.every)
    record.probe()
    if not any("resumed from" in line for _, line in second["log"]):
      raise RuntimeError("the rerun did not restore a checkpoint:\n" +
                         "".join(l for _, l in second["log"]))
    runs += [first, second]
    if label == "baseline":
      # The process constant: imports, jax, compiled programs, orbax, the data
      # pipeline; what the same schedule holds beside tables too small to count.
      constant = max(max(r for _, r in run["samples"]) for run in (first, second)) - state(rows)
      print(f"baseline, 26 tables of {rows:,} rows: process constant {constant / 1e9:.2f} GB")
      record.add_case("process constant", constant / 1e9, "GB")
      continue
    record.add_case("state", state(rows) / 1e9, "GB")
    report("training run", first, state(rows), constant, record, "training")
    report("rerun that restores, trains, evaluates and saves", second, state(rows), constant,
           record, "rerun")
  if args.trace:
    with open(args.trace, "w") as f:
      for i, run in enumerate(runs):
        f.writelines(f"{i} {t:.2f} {rss}\n" for t, rss in run["samples"])
        f.writelines(f"# {i} {t:.2f} {line}" for t, line in run["log"])
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
