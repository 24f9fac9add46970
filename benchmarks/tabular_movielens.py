"""ML-100K clicks with side columns: embedlib's tabular models beside RecBole 1.2.1's CTR models.

    bash benchmarks/install_peers.sh                  # first, for the RecBole rows
    python3 benchmarks/tabular_movielens.py           # RecBole's own ML-100K files
    python3 benchmarks/tabular_movielens.py --data DIR/ml-100k.inter --seeds 0,1,2 \
        --recbole FM,DeepFM,WideDeep,DCNV2 --out DIR
    python3 benchmarks/tabular_movielens.py --set model.embed_dim=32   # a configs/tabular.py key
    python3 benchmarks/tabular_movielens.py --smoke   # tiny models and schedules: a smoke run

``--data`` is RecBole's atomic ML-100K (``ml-100k.inter`` with its
``.user`` and ``.item`` beside it); by default the copy in the ``.peers``
RecBole wheel, else ``/work/data/recbole/dataset_example/ml-100k``. The
task is RecBole's CTR one: a rating of 4 or 5 is a click (``threshold:
{rating: 4}``, ``--config.data.label_threshold=4``).

One split for everyone: embedlib's hash split of the ``.inter`` rows
(``configs/tabular.py``: eval 10%, test 10%, by a hash of the row number)
is written as RecBole benchmark files (``<name>.train.inter``,
``.valid.inter``, ``.test.inter`` beside copies of the ``.user`` and
``.item`` files; RecBole's ``benchmark_filename: [train, valid, test]``
then takes those rows as its three parts, in order, instead of splitting
itself). The parts' rows are found with embedlib's own chunking of the
file (``tabular.files.chunks``), and each side's parts are checked: every
RecBole run reports its parts' rows and clicks, every embedlib run its
training rows; a run whose parts differ is reported as such and left out
of the targets.

Runs, each its own process, interleaved per seed (one of ours, one of
RecBole's, ...), so that the machine's load hits both sides alike:

- embedlib (``python -m train``'s ``train_and_evaluate`` on
  ``configs/tabular.py``, one CPU device): ``dlrm`` and ``dcn_v2`` with
  every side column (age, gender, occupation, zip, release year, genres,
  title tokens) and with the two ids only; test AUC and log-loss with the
  best eval's weights. ``two_tower`` the same two ways: test recall@100
  (each positive test row's item ranked among the training rows' items).
- RecBole (``benchmarks/peers/recbole_ctr.py`` in ``.peers``):
  ``--recbole`` context-aware models at their documented settings (each
  model's own defaults and RecBole's: Adam, lr 1e-3, batch 2048, early
  stopping after 10 evals without a better valid AUC), the side columns
  of PEERS.md's recipe (``load_col``: user age, gender, occupation, zip;
  item release year, genres), test AUC and log-loss with its best weights.

Per case: min / median / max over ``--seeds`` of the test metrics and of
the wall seconds (in the run's process: reading the files, building,
training, testing; imports and start-up left out), the load average before
and after. Then named ratios (AUC differences, wall-time ratios) and the
issue's targets, each marked met or not. Without ``.peers/`` the RecBole
rows are skipped with a note. Never asserts a time.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import shutil
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

PEER_PYTHON = os.path.join(ROOT, ".peers", "bin", "python")
RECBOLE_SCRIPT = os.path.join(HERE, "peers", "recbole_ctr.py")
FALLBACK_DATA = "/work/data/recbole/dataset_example/ml-100k/ml-100k.inter"
RESULT = "@@result "
#: The side columns of ML-100K's .user and .item files (left out: ids only).
SIDE_COLUMNS = ("age", "gender", "occupation", "zip_code", "movie_title", "release_year",
                "class")
LABEL, THRESHOLD = "rating", 4.0
#: The RecBole dataset name of the written split (not "ml-100k": RecBole reads its
#: own copy of that one whatever data_path says).
SPLIT_NAME = "ml100k-embedlib-split"
PARTS = (("train", "train"), ("eval", "valid"), ("test", "test"))  # ours, RecBole's
#: embedlib's cases (``--cases``): key -> (model.name, side columns read).
EMBEDLIB_CASES = {
    "dlrm": ("dlrm", True),
    "dlrm-ids": ("dlrm", False),
    "dcn_v2": ("dcn_v2", True),
    "dcn_v2-ids": ("dcn_v2", False),
    "two_tower": ("two_tower", True),
    "two_tower-ids": ("two_tower", False),
}
RECBOLE_MODELS = "FM,DeepFM,WideDeep,DCNV2"
RECALL = "recall@100"


# -- the data and its split ---------------------------------------------------------


def default_data() -> str:
  """ML-100K's ``.inter`` in the ``.peers`` RecBole wheel, else the copy under /work/data."""
  found = sorted(glob.glob(os.path.join(
      ROOT, ".peers", "lib", "python3*", "site-packages", "recbole", "dataset_example",
      "ml-100k", "ml-100k.inter")))
  return found[0] if found else FALLBACK_DATA


def split_config(smoke: bool = False):
  """configs/tabular.py's split settings (the benchmark's embedlib runs use them as they are)."""
  from configs import tabular as tabular_config  # pylint: disable=g-import-not-at-top
  from embedlib.tabular import split as split_lib  # pylint: disable=g-import-not-at-top

  data = tabular_config.get_config("smoke" if smoke else None).data
  return split_lib.Split(data.split, eval_fraction=data.eval_fraction,
                         test_fraction=data.test_fraction, seed=data.split_seed)


def write_split(inter_path: str, out_dir: str, name: str = SPLIT_NAME, split=None) -> dict:
  """Writes ``inter_path``'s rows as RecBole benchmark files of embedlib's split.

  The rows are numbered as embedlib's reader numbers them (its chunks of
  the file, ``tabular.files.chunks``), so each file holds exactly the rows
  of that part. The dataset's ``.user`` and ``.item`` files are copied
  beside them.

  Args:
    inter_path: a RecBole ``.inter`` file.
    out_dir: RecBole's ``data_path``; the files go in ``out_dir/name/``.
    name: the dataset name.
    split: a ``tabular.Split`` (default: ``configs/tabular.py``'s).

  Returns:
    ``{"train" | "valid" | "test": {"rows": n, "clicks": k}}`` (RecBole's
    part names; a click: ``rating >= THRESHOLD``).
  """
  from embedlib import tabular  # pylint: disable=g-import-not-at-top

  split = split or split_config()
  files = tabular.find(inter_path, "recbole")
  label = files.header.index(f"{LABEL}:float")
  folder = os.path.join(out_dir, name)
  os.makedirs(folder, exist_ok=True)
  header = ("\t".join(files.header) + "\n").encode()
  outs = {theirs: open(os.path.join(folder, f"{name}.{theirs}.inter"), "wb")
          for _, theirs in PARTS}
  counts = {theirs: {"rows": 0, "clicks": 0} for _, theirs in PARTS}
  import numpy as np  # pylint: disable=g-import-not-at-top

  try:
    for f in outs.values():
      f.write(header)
    for chunk in tabular.files.chunks(files):
      with open(chunk.path, "rb") as f:
        f.seek(chunk.start)
        lines = f.read(chunk.stop - chunk.start).splitlines(keepends=True)
      if len(lines) != chunk.rows:
        raise RuntimeError(f"{chunk.path}: {len(lines)} lines where embedlib's chunk holds "
                           f"{chunk.rows} rows")
      rows = chunk.first_row + np.arange(chunk.rows, dtype=np.int64)
      for ours, theirs in PARTS:
        for i in np.flatnonzero(split.mask(ours, rows, None)):
          line = lines[i] if lines[i].endswith(b"\n") else lines[i] + b"\n"
          outs[theirs].write(line)
          counts[theirs]["rows"] += 1
          counts[theirs]["clicks"] += float(line.split(b"\t")[label]) >= THRESHOLD
  finally:
    for f in outs.values():
      f.close()
  base = inter_path[:-len(".inter")]
  for side in (".user", ".item"):
    if os.path.exists(base + side):
      shutil.copy(base + side, os.path.join(folder, name + side))
  return counts


# -- the embedlib side (a worker process per run) -------------------------------------


def case_name(key: str) -> str:
  """The printed name of an embedlib case: ``embedlib dlrm, side columns``."""
  model, sides = EMBEDLIB_CASES[key]
  return f"embedlib {model}, {'side columns' if sides else 'ids only'}"


def set_key(config, key: str, value) -> None:
  *parents, leaf = key.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = value


def embedlib_config(data: str, model: str, sides: bool, seed: int, overrides=(),
                    smoke: bool = False):
  """configs/tabular.py for one case: ``model``, with or without the side columns."""
  from configs import tabular as tabular_config  # pylint: disable=g-import-not-at-top

  config = tabular_config.get_config(f"smoke,{data}" if smoke else data)
  config.seed = seed
  config.data.label = LABEL
  config.data.label_threshold = THRESHOLD
  config.model.name = model
  if not sides:
    config.data.ignore = ",".join(SIDE_COLUMNS)
  for item in overrides:
    key, _, value = item.partition("=")
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass  # a plain string
    set_key(config, key, value)
  return config


def embedlib_worker(args) -> None:
  """Trains one case and prints its ``@@result`` line."""
  from embedlib.training import train_and_evaluate  # pylint: disable=g-import-not-at-top

  model, sides = EMBEDLIB_CASES[args.case]
  config = embedlib_config(args.data, model, sides, args.seed, args.set or (), args.smoke)
  start = time.perf_counter()
  final = train_and_evaluate(config, args.workdir)
  wall = time.perf_counter() - start
  with open(os.path.join(args.workdir, "statistics.json"), encoding="utf-8") as f:
    train_rows = int(json.load(f)["rows"])
  evals = []
  if os.path.exists(os.path.join(args.workdir, "eval.jsonl")):
    with open(os.path.join(args.workdir, "eval.jsonl"), encoding="utf-8") as f:
      evals = [json.loads(line) for line in f if line.strip()]
  test = {k[len("test_"):]: float(v) for k, v in final.items() if k.startswith("test_")}
  watched = RECALL if model == "two_tower" else "auc"
  print(RESULT + json.dumps({
      "case": args.case, "seed": args.seed, "test": test, "wall_s": wall,
      "train_rows": train_rows, "best_step": final.get("best_step"),
      "best_eval": max((e[watched] for e in evals if watched in e), default=None),
      "curve": [[e["step"], round(e[watched], 5)] for e in evals if watched in e],
      "steps": evals[-1]["step"] if evals else None, "evals": len(evals),
      "batch_size": config.batch_size, "peak_rss_mib": peak_rss_mib(),
  }), flush=True)


# -- running and collecting -------------------------------------------------------------


def _run(argv, env, label: str) -> dict:
  load = os.getloadavg()[0]
  tic = time.perf_counter()
  proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
  if proc.returncode or not lines:
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-20:])
    raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{tail}")
  result = json.loads(lines[-1][len(RESULT):])
  result.update(process_s=time.perf_counter() - tic, load_before=load,
                load_after=os.getloadavg()[0])
  metric = RECALL if RECALL in result["test"] else "auc"
  best = f" (best eval {result['best_eval']:.4f})" if result.get("best_eval") else ""
  print(f"  {label}: test {metric} {result['test'][metric]:.4f}{best}, {result['wall_s']:.0f} s "
        f"(load {load:.1f} -> {result['load_after']:.1f})", flush=True)
  return result


def run_embedlib(case: str, seed: int, args, workroot: str) -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(
                 os.pathsep))
  workdir = os.path.join(workroot, f"{case}_{seed}")
  argv = [sys.executable, os.path.abspath(__file__), "--worker", "--case", case,
          "--seed", str(seed), "--data", args.data, "--workdir", workdir]
  argv += ["--smoke"] * args.smoke
  for item in args.set or ():
    argv += ["--set", item]
  return _run(argv, env, f"{case_name(case)}, seed {seed}")


def run_recbole(model: str, seed: int, args, data_path: str) -> dict:
  env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
  argv = [PEER_PYTHON, RECBOLE_SCRIPT, "--model", model, "--seed", str(seed),
          "--data-path", data_path, "--dataset", SPLIT_NAME, "--threads", str(args.threads)]
  argv += ["--smoke"] * args.smoke
  return _run(argv, env, f"RecBole {model}, seed {seed}")


def order(embedlib_cases, recbole_models) -> list[tuple[str, str]]:
  """Ours and RecBole's alternating: ``[("embedlib", case) | ("recbole", model)]``."""
  ours = [("embedlib", c) for c in embedlib_cases]
  theirs = [("recbole", m) for m in recbole_models]
  out = []
  for i in range(max(len(ours), len(theirs))):
    out += ours[i:i + 1] + theirs[i:i + 1]
  return out


# -- the report --------------------------------------------------------------------------


def spread(values) -> dict:
  values = [v for v in values if v is not None]
  if not values:
    return {}
  return {"min": min(values), "median": statistics.median(values), "max": max(values),
          "values": list(values)}


def summarize(runs: dict[str, list[dict]], expected: dict) -> dict:
  """``{case: {metric: spread}}`` of every case's runs, the split checked.

  A RecBole run whose parts differ from ``expected`` (``write_split``'s
  counts), or an embedlib run whose training rows do, is marked
  ``split_ok: False``.
  """
  cases = {}
  for name, rs in runs.items():
    out = {"runs": len(rs)}
    for metric in sorted({m for r in rs for m in r["test"]}):
      out[metric] = spread([r["test"].get(metric) for r in rs])
    for key in ("wall_s", "process_s", "peak_rss_mib", "epochs", "load_before", "load_after"):
      s = spread([r.get(key) for r in rs])
      if s:
        out[key] = s
    if name.startswith("RecBole"):
      out["split_ok"] = all(r.get("parts") == expected for r in rs)
    else:
      out["split_ok"] = all(r.get("train_rows") == expected["train"]["rows"] for r in rs)
    cases[name] = out
  return cases


def _median(cases, name, metric):
  return cases[name][metric]["median"] if name in cases and metric in cases[name] else None


def ratios(cases: dict) -> dict:
  """The named comparisons (medians over seeds): AUC gains and differences, wall-time ratios."""
  out = {}
  for model in ("dlrm", "dcn_v2"):
    side, ids = f"embedlib {model}, side columns", f"embedlib {model}, ids only"
    if side in cases and ids in cases:
      out[f"{model}: side columns - ids only, test AUC"] = (
          _median(cases, side, "auc") - _median(cases, ids, "auc"))
  side, ids = "embedlib two_tower, side columns", "embedlib two_tower, ids only"
  if side in cases and ids in cases:
    out[f"two_tower: side columns / ids only, test {RECALL}"] = (
        _median(cases, side, RECALL) / _median(cases, ids, RECALL))
  ours = [n for n in cases if n.startswith("embedlib") and "auc" in cases[n]]
  theirs = [n for n in cases if n.startswith("RecBole") and "auc" in cases[n]
            and cases[n]["split_ok"]]
  if ours and theirs:
    best_ours = max(ours, key=lambda n: _median(cases, n, "auc"))
    best_theirs = max(theirs, key=lambda n: _median(cases, n, "auc"))
    out["best embedlib - best RecBole, test AUC"] = (
        _median(cases, best_ours, "auc") - _median(cases, best_theirs, "auc"))
    out["best embedlib / best RecBole, wall s"] = (
        _median(cases, best_ours, "wall_s") / _median(cases, best_theirs, "wall_s"))
    out["best embedlib"], out["best RecBole"] = best_ours, best_theirs
  return out


def print_table(cases: dict) -> None:
  print(f"\n{'case':36s} {'test AUC min / median / max':>28s} {'logloss (median)':>17s} "
        f"{RECALL + ' (median)':>19s} {'wall s min / med / max':>23s} {'load':>11s}")
  for name, c in cases.items():
    auc = c.get("auc")
    auc_text = f"{auc['min']:.4f} {auc['median']:.4f} {auc['max']:.4f}" if auc else "-"
    logloss = f"{c['logloss']['median']:.4f}" if "logloss" in c else "-"
    recall = f"{c[RECALL]['median']:.4f}" if RECALL in c else "-"
    w = c["wall_s"]
    load = (f"{c['load_before']['median']:.1f}-{c['load_after']['median']:.1f}"
            if "load_before" in c else "-")
    flag = "" if c["split_ok"] else "  (its split differs: left out)"
    print(f"{name:36s} {auc_text:>28s} {logloss:>17s} {recall:>19s} "
          f"{w['min']:7.0f} {w['median']:7.0f} {w['max']:7.0f} {load:>11s}{flag}")
  if any(RECALL in c for c in cases.values()):
    print(f"  two towers, {RECALL} min / median / max: " + "; ".join(
        f"{n}: {c[RECALL]['min']:.4f} / {c[RECALL]['median']:.4f} / {c[RECALL]['max']:.4f}"
        for n, c in cases.items() if RECALL in c))
  print("  wall s: in the run's process (files read, model built, trained, tested); load: "
        "1-minute load average before-after (median over the runs)")


def print_targets(named: dict) -> None:
  checks = []
  for model in ("dlrm", "dcn_v2"):
    key = f"{model}: side columns - ids only, test AUC"
    if key in named:
      checks.append((f"{model} side columns worth >= +0.01 test AUC over ids only: "
                     f"{named[key]:+.4f}", named[key] >= 0.01))
  key = "best embedlib - best RecBole, test AUC"
  if key in named:
    checks.append((f"test AUC above RecBole's best context-aware model: {named['best embedlib']} "
                   f"vs {named['best RecBole']}: {named[key]:+.4f}", named[key] > 0))
  print("\nRatios and differences (medians over seeds):")
  for k, v in named.items():
    if not isinstance(v, str):
      print(f"  {k}: {v:+.4f}" if "-" in k.split(":")[-1] else f"  {k}: {v:.3f}")
  print("Targets (issue 52):")
  for text, ok in checks:
    print(f"  [{'met' if ok else 'NOT met'}] {text}")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", default=None, help="RecBole's ml-100k.inter (module docstring)")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--cases", default=",".join(EMBEDLIB_CASES),
                      help="embedlib's cases, comma-separated, of "
                           f"{', '.join(EMBEDLIB_CASES)} ('none': RecBole's only)")
  parser.add_argument("--recbole", default=RECBOLE_MODELS,
                      help="RecBole models, comma-separated ('none': embedlib's only)")
  parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                      help="override a configs/tabular.py value in embedlib's runs")
  parser.add_argument("--threads", type=int, default=2, help="torch threads for RecBole")
  parser.add_argument("--out", default=None, help="write the results here (JSON)")
  timing.add_json_argument(parser)
  parser.add_argument("--report", default=None, metavar="FILE[,FILE]",
                      help="run nothing: report the runs of these --out files together (e.g. "
                           "one run per seed, made side by side)")
  parser.add_argument("--smoke", action="store_true",
                      help="configs/tabular.py:smoke and a few RecBole batches: a smoke run")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--case", help=argparse.SUPPRESS)
  parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--workdir", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.data = args.data or default_data()
  if args.worker:
    return embedlib_worker(args)

  if args.report:
    return report(args.report.split(","), args.out)
  run = timing.Run("tabular_movielens", argv, smoke=args.smoke)
  seeds = [int(s) for s in args.seeds.split(",")]
  ours = [c for c in args.cases.split(",") if c and c != "none"]
  unknown = set(ours) - set(EMBEDLIB_CASES)
  if unknown:
    parser.error(f"--cases: unknown {sorted(unknown)}; use some of {list(EMBEDLIB_CASES)}")
  theirs = [m for m in args.recbole.split(",") if m and m != "none"]
  notes = []
  if theirs and not os.path.exists(PEER_PYTHON):
    notes.append(f"RecBole rows skipped: {PEER_PYTHON} not found; install the peers with "
                 "`bash benchmarks/install_peers.sh` (../shared/PEERS.md).")
    theirs = []
  for note in notes:
    print(f"note: {note}")
  print(f"data: {args.data}; seeds {seeds}; cpus {os.cpu_count()}, load average "
        f"{os.getloadavg()[0]:.1f}", flush=True)
  runs: dict[str, list[dict]] = {}
  with tempfile.TemporaryDirectory(prefix="tabular_movielens_") as tmp:
    expected = write_split(args.data, tmp, split=split_config(args.smoke))
    print("split (embedlib's hash split, written as RecBole benchmark files): " + ", ".join(
        f"{part} {c['rows']} rows, {c['clicks']} clicks" for part, c in expected.items()),
        flush=True)
    for seed in seeds:
      for side, name in order(ours, theirs):
        if side == "embedlib":
          runs.setdefault(case_name(name), []).append(run_embedlib(name, seed, args, tmp))
        else:
          runs.setdefault(f"RecBole {name}", []).append(run_recbole(name, seed, args, tmp))
      run.probe()
  results = {"benchmark": "tabular_movielens", "data": args.data, "seeds": seeds,
             "split": expected, "notes": notes, "overrides": list(args.set or ()),
             "smoke": args.smoke}
  return finish(results, runs, args.out, run, args.json)


def finish(results: dict, runs: dict, out: str | None, run: timing.Run | None = None,
           json_path: str | None = None) -> dict:
  """Summarizes ``runs``, prints the table and targets, writes ``out`` (with the runs).

  With ``run`` (a run made here, not ``--report``'s), its record gets each
  case's test metrics and wall seconds over the seeds and the numeric ratios,
  and is written to ``json_path``.
  """
  cases = summarize(runs, results["split"])
  named = ratios(cases)
  print_table(cases)
  print_targets(named)
  if run is not None:
    for name, rs in runs.items():
      for metric in sorted({m for r in rs for m in r["test"]}):
        values = [r["test"][metric] for r in rs if r["test"].get(metric) is not None]
        if values:
          run.add_case(f"{name}: test {metric}", values, unit=metric)
      walls = [r["wall_s"] for r in rs if r.get("wall_s") is not None]
      if walls:
        run.add_case(f"{name}: wall", walls, unit="s")
    for name, value in named.items():
      if isinstance(value, (int, float)):
        run.ratio(name, value)
    run.finish(json_path)
  results = {**results, "cases": cases, "ratios": named}
  if out:
    with open(out, "w", encoding="utf-8") as f:
      json.dump({**results, "runs": runs}, f, indent=1)
  return results


def report(paths, out: str | None) -> dict:
  """The runs of several ``--out`` files reported as one run (their splits must agree)."""
  runs, results = {}, None
  for path in paths:
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    if results is not None and saved["split"] != results["split"]:
      raise SystemExit(f"{path}: its split differs from {paths[0]}'s; report them apart.")
    if results is None:
      results = {k: saved[k] for k in ("benchmark", "data", "split", "notes", "overrides",
                                        "smoke")}
      results["seeds"] = []
    results["seeds"] += saved["seeds"]
    for name, rs in saved["runs"].items():
      runs.setdefault(name, []).extend(rs)
  print(f"runs of {', '.join(paths)}: seeds {results['seeds']}")
  return finish(results, runs, out)


if __name__ == "__main__":
  main()
