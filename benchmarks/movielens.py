"""MovieLens-100K next-item: embedlib's SASRec and HSTU beside RecBole 1.2.1's SASRec and BPR.

    bash benchmarks/install_peers.sh                      # first, for the RecBole rows
    python3 benchmarks/movielens.py --data /work/data/ml-100k    # the configs' defaults
    python3 benchmarks/movielens.py --data /work/data/ml-100k --steps 1140 \
        --set batch_size=64 --set data.stride=50 --set eval_every=190 --out DIR
    python3 benchmarks/movielens.py --data ... --models sasrec --label masked \
        --set task.mask_seen=True ...       # embedlib on BPR's protocol, as sasrec-masked
    python3 benchmarks/movielens.py --data ... --models sasrec,hstu --label plain \
        --set model.repeat_bias=False ...   # without the repeat bias, as sasrec-plain
    python3 benchmarks/movielens.py --data ... --reuse DIR --report-only   # report DIR's runs
    python3 benchmarks/movielens.py --data ... --json run.json  # also the run's record (timing.Run)

``--data`` is RecBole's ML-100K atomic files (``ml-100k.inter`` and
``ml-100k.item``), e.g. unzipped from its wheel::

    pip download --no-deps recbole==1.2.1 -d /tmp/w
    unzip /tmp/w/recbole-1.2.1-*.whl 'recbole/dataset_example/ml-100k/*' -d /tmp/w
    mv /tmp/w/recbole/dataset_example/ml-100k /work/data/

One protocol for every model: each user's ratings in time order, the last
one the test target, the one before it validation, the rest training
(RecBole's ``eval_args`` split ``{'LS': 'valid_and_test'}``, order ``TO``),
and the target ranked among all 1,682 items (mode ``full``; for the
sequential models seen items are not masked, as RecBole does; BPR's
evaluation masks a user's training items, as RecBole does for general
models). embedlib's split comes from ``embedlib.data.movielens``, whose
remap and time order follow RecBole's; the benchmark checks that both sides
hold out the same validation and test item for every user and prints how
many differ. Metrics: HR@10, NDCG@10, MRR@10 on test, each side's own
implementation (``embedlib.metrics.full_ranking``; RecBole's evaluator).

Each run is its own process (its own peak RSS), one after the other:

- embedlib ``sasrec`` and ``hstu``: ``configs/movielens.py`` (with its
  learned repeat bias, ``embedlib.models.next_item``; ``-plain`` runs without) through
  ``train_and_evaluate`` on one CPU device (``--steps`` overrides the
  config's step count); the validation metrics are timed as each eval
  lands in ``eval.jsonl``, the test metrics come from its last record.
- RecBole ``BPR`` (trained to its early stop; its test also evaluated with
  seen items ranked, the row ``RecBole BPR, seen ranked``) and ``SASRec`` (CE loss,
  stopped at ``--recbole-budget-s`` of wall clock; an epoch takes longer
  than a benchmark can give it on a CPU), ``benchmarks/peers/recbole_movielens.py``.

Per model: test metrics as mean ± standard deviation over ``--seeds``, epochs, wall seconds (training and evaluation, after the data is
loaded), seconds per epoch (training steps only), peak RSS. Then the issue's
targets, each marked met or not, and embedlib's SASRec at RecBole SASRec's
budget. Without ``.peers/`` the RecBole rows are skipped with a note.
``--json FILE`` keeps the run's record (``benchmarks/timing.py``): each
model's test metrics and seconds per epoch over the seeds, and the named
ratios ``sasrec_ndcg_over_bpr`` (embedlib SASRec's mean test NDCG@10 over
RecBole BPR's), ``hstu_ndcg_over_sasrec`` and
``recbole_sasrec_epoch_over_ours`` (RecBole SASRec's seconds per epoch
over embedlib's), where the run has both sides, beside the machine's state
(a copy probe after each run). Never asserts a time.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
sys.path.insert(1, ROOT)
sys.path.insert(2, HERE)

import timing  # noqa: E402
from worker_protocol import peak_rss_mib  # noqa: E402

PEER_PYTHON = os.path.join(ROOT, ".peers", "bin", "python")
RECBOLE_SCRIPT = os.path.join(HERE, "peers", "recbole_movielens.py")
EMBEDLIB_MODELS = ("sasrec", "hstu")
RECBOLE_MODELS = ("BPR", "SASRec")
METRICS = ("hit@10", "ndcg@10", "mrr@10")
RESULT = "@@result "
#: RecBole BPR's runs tested again with seen items ranked (their ``test_rank_seen``).
BPR_RANK_SEEN = "RecBole BPR, seen ranked"
#: The label of embedlib's runs without the repeat bias (the paper's SASRec).
PLAIN = "plain"


# -- the embedlib side (a worker process per run) ---------------------------------


def embedlib_worker(args) -> None:
  """Trains one configs/movielens.py variant and prints its ``@@result`` line."""
  from configs import movielens as movielens_config  # pylint: disable=g-import-not-at-top
  from embedlib.data import next_item  # pylint: disable=g-import-not-at-top
  from embedlib.training import train_and_evaluate  # pylint: disable=g-import-not-at-top
  from embedlib.training import setup  # pylint: disable=g-import-not-at-top

  config = movielens_config.get_config(f"{args.variant},{args.data}")
  config.seed = args.seed
  for item in args.set or ():
    key, _, value = item.partition("=")
    *parents, leaf = key.split(".")
    node = config
    for name in parents:
      node = node[name]
    node[leaf] = ast.literal_eval(value)
  if args.steps:
    config.num_train_steps = args.steps
    config.eval_every = min(config.eval_every, args.steps)
  split = setup.task(config).split
  source = next_item.NextItemSource(split, max_len=config.data.max_len,
                                    stride=config.data.stride,
                                    batch_size=config.batch_size, seed=config.seed)
  timeline, stop = [], threading.Event()
  eval_path = os.path.join(args.workdir, "eval.jsonl")
  start = time.perf_counter()

  def watch():  # times each eval as it lands
    seen = 0
    while True:
      done = stop.wait(0.25)
      if os.path.exists(eval_path):
        with open(eval_path, encoding="utf-8") as f:
          records = [json.loads(line) for line in f if line.strip()]
        for record in records[seen:]:
          timeline.append({"t": round(time.perf_counter() - start, 2), **record})
        seen = len(records)
      if done:
        return

  watcher = threading.Thread(target=watch, daemon=True)
  watcher.start()
  final = train_and_evaluate(config, args.workdir)
  wall = time.perf_counter() - start
  stop.set()
  watcher.join()
  with open(os.path.join(args.workdir, "train.jsonl"), encoding="utf-8") as f:
    rates = [r["examples_per_sec"] for r in map(json.loads, filter(str.strip, f))
             if "examples_per_sec" in r]
  steps_per_epoch = source.batches_per_epoch
  s_per_epoch = (steps_per_epoch * config.batch_size / statistics.median(rates)) if rates else None
  test = {k[len("test_"):]: float(v) for k, v in final.items() if k.startswith("test_")}
  test = {k.replace("hr@", "hit@"): v for k, v in test.items()}
  print(RESULT + json.dumps({
      "model": args.variant, "seed": args.seed, "test": test,
      "epochs": round(config.num_train_steps / steps_per_epoch, 3),
      "steps_per_epoch": steps_per_epoch, "wall_s": wall, "s_per_epoch": s_per_epoch,
      "valid_curve": [{"t": r["t"], "epochs": round(r["step"] / steps_per_epoch, 3),
                       **{k.replace("hr@", "hit@"): v for k, v in r.items()
                          if "@" in k and not k.startswith("test_")}} for r in timeline],
      "peak_rss_mib": peak_rss_mib(),
  }), flush=True)


# -- running and collecting -------------------------------------------------------


def _run(argv, env=None, label="") -> dict:
  t = time.perf_counter()
  proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
  if proc.returncode or not lines:
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
    raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{tail}")
  result = json.loads(lines[-1][len(RESULT):])
  print(f"  {label}: {time.perf_counter() - t:.0f} s, test NDCG@10 "
        f"{result['test'].get('ndcg@10', float('nan')):.4f}", flush=True)
  return result


def run_embedlib(model, seed, args, workroot) -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
  argv = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", model,
          "--seed", str(seed), "--data", args.data,
          "--workdir", os.path.join(workroot, f"{model}_{seed}")]
  if args.steps:
    argv += ["--steps", str(args.steps)]
  for item in args.set or ():
    argv += ["--set", item]
  return _run(argv, env, f"embedlib {model} seed {seed}")


def run_recbole(model, seed, args, split_out=None) -> dict:
  env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
  argv = [PEER_PYTHON, RECBOLE_SCRIPT, "--model", model, "--seed", str(seed),
          "--threads", str(args.threads)]
  if model == "SASRec":
    argv += ["--budget-s", str(args.recbole_budget_s)]
  if split_out:
    argv += ["--split-out", split_out]
  return _run(argv, env, f"RecBole {model} seed {seed}")


def compare_splits(data_path: str, recbole_split_path: str) -> tuple[int, int]:
  """(users whose validation or test item differs, users) between the two sides."""
  from embedlib.data import movielens  # pylint: disable=g-import-not-at-top
  data = movielens.load(data_path)
  split = movielens.leave_one_out(data)
  with open(recbole_split_path, encoding="utf-8") as f:
    theirs = json.load(f)
  differ = 0
  for u in range(split.num_users):
    raw = str(data.raw_user_ids[u])
    mine = (str(data.raw_item_ids[split.valid_item[u]]), str(data.raw_item_ids[split.test_item[u]]))
    differ += theirs.get(raw) != {"valid": mine[0], "test": mine[1]}
  return differ, split.num_users


# -- the report -------------------------------------------------------------------


def _stats(values):
  mean = statistics.fmean(values)
  std = statistics.stdev(values) if len(values) > 1 else 0.0
  return mean, std, min(values), max(values)


def summarize(name: str, runs: list[dict]) -> dict:
  """Mean / spread over seeds of one model's runs."""
  out = {"name": name, "seeds": [r["seed"] for r in runs]}
  for m in METRICS:
    out[m] = _stats([r["test"][m] for r in runs])
  for key in ("epochs", "wall_s", "s_per_epoch", "peak_rss_mib"):
    values = [r[key] for r in runs if r.get(key) is not None]
    out[key] = statistics.fmean(values) if values else float("nan")
  return out


def print_table(rows: list[dict]) -> None:
  print(f"\n{'model':<26}" + "".join(f"{m.upper().replace('HIT', 'HR'):>24}" for m in METRICS)
        + f"{'epochs':>9}{'wall s':>9}{'s/epoch':>9}{'RSS MiB':>9}")
  for r in rows:
    cells = "".join(f"{f'{r[m][0]:.4f} ± {r[m][1]:.4f}':>24}" for m in METRICS)
    print(f"{r['name']:<26}{cells}{r['epochs']:>9.1f}{r['wall_s']:>9.0f}"
          f"{r['s_per_epoch']:>9.2f}{r['peak_rss_mib']:>9.0f}")
  print("  (mean ± standard deviation over seeds " + ", ".join(
      f"{r['name']}: {r['seeds']}" for r in rows) + ")")


def at_budget(run: dict, budget: float) -> tuple[str, float]:
  """embedlib's NDCG@10 within ``budget`` s: its test figure if it finished, else its last
  validation figure before the budget ran out."""
  if run["wall_s"] <= budget:
    return "test, finished", run["test"]["ndcg@10"]
  before = [r for r in run["valid_curve"] if r["t"] <= budget]
  if not before:
    return "nothing evaluated yet", float("nan")
  return f"validation at {before[-1]['t']:.0f} s", before[-1]["ndcg@10"]


def print_targets(summary: dict, runs: dict, budget: float) -> None:
  def mean(name, metric="ndcg@10"):
    return summary[name][metric][0] if name in summary else float("nan")

  checks = []
  if "embedlib sasrec" in summary and "RecBole BPR" in summary:
    ratio = mean("embedlib sasrec") / mean("RecBole BPR")
    checks.append((f"embedlib SASRec test NDCG@10 >= 1.25 x RecBole BPR's: {ratio:.2f}x",
                   ratio >= 1.25))
  if "embedlib sasrec" in summary and BPR_RANK_SEEN in summary:
    ratio = mean("embedlib sasrec") / mean(BPR_RANK_SEEN)
    checks.append((f"the same, both evaluations ranking seen items (the sequential protocol): "
                   f"{ratio:.2f}x", ratio >= 1.25))
  if "embedlib sasrec-masked" in summary and "RecBole BPR" in summary:
    ratio = mean("embedlib sasrec-masked") / mean("RecBole BPR")
    checks.append((f"the same, both evaluations leaving seen items out (BPR's protocol): "
                   f"{ratio:.2f}x", ratio >= 1.25))
  if "embedlib sasrec" in summary and "RecBole SASRec" in summary:
    ratio = summary["RecBole SASRec"]["s_per_epoch"] / summary["embedlib sasrec"]["s_per_epoch"]
    checks.append((f"embedlib SASRec epoch >= 20x faster than RecBole SASRec's: {ratio:.0f}x",
                   ratio >= 20))
    print(f"\nAt RecBole SASRec's budget of {budget:.0f} s (test NDCG@10 per seed):")
    for ours, theirs in zip(runs["embedlib sasrec"], runs["RecBole SASRec"]):
      kind, value = at_budget(ours, budget)
      print(f"  seed {ours['seed']}: embedlib SASRec {value:.4f} ({kind}, {ours['wall_s']:.0f} s "
            f"for {ours['epochs']:.0f} epochs); RecBole SASRec {theirs['test']['ndcg@10']:.4f} "
            f"after {theirs['epochs']:.2f} epochs")
    print("Validation NDCG@10 at each of RecBole SASRec's evaluations, beside embedlib SASRec's "
          "last evaluation by then:")
    for ours, theirs in zip(runs["embedlib sasrec"], runs["RecBole SASRec"]):
      for point in theirs["valid_curve"]:
        before = [r for r in ours["valid_curve"] if r["t"] <= point["t"]]
        mine = f"{before[-1]['ndcg@10']:.4f} ({before[-1]['epochs']:.0f} epochs)" if before else "none"
        print(f"  seed {ours['seed']}, {point['t']:.0f} s: RecBole {point['ndcg@10']:.4f} "
              f"({point['epochs']:.2f} epochs), embedlib {mine}")
    ours = statistics.fmean(at_budget(r, budget)[1] for r in runs["embedlib sasrec"])
    checks.append((f"embedlib SASRec above RecBole SASRec at {budget:.0f} s: {ours:.4f} vs "
                   f"{mean('RecBole SASRec'):.4f}", ours > mean("RecBole SASRec")))
  if "embedlib sasrec" in summary and "embedlib hstu" in summary:
    checks.append((f"embedlib HSTU above embedlib SASRec: {mean('embedlib hstu'):.4f} vs "
                   f"{mean('embedlib sasrec'):.4f}", mean("embedlib hstu") > mean("embedlib sasrec")))
  print("\nTargets (issue 25):")
  for text, ok in checks:
    print(f"  [{'met' if ok else 'NOT met'}] {text}")
  plain = [name for name in summary if name.endswith(f"-{PLAIN}")]
  if plain and "RecBole BPR" in summary:
    print(f"Without the repeat bias (--label {PLAIN} --set model.repeat_bias=False), test "
          "NDCG@10 against RecBole BPR's: " + "; ".join(
              f"{name} {mean(name):.4f} ({mean(name) / mean('RecBole BPR'):.2f}x)"
              for name in plain))


def record_figures(record, summary: dict, runs: dict) -> None:
  """Each model's test metrics and s / epoch over the seeds, and the named ratios of means."""
  for name, rs in runs.items():
    for m in METRICS:
      record.add_case(f"{name}: test {m}", [r["test"][m] for r in rs], m)
    epochs = [r["s_per_epoch"] for r in rs if r.get("s_per_epoch") is not None]
    if epochs:
      record.add_case(f"{name}: s per epoch", epochs, "s")

  def mean(name, key="ndcg@10"):
    return summary[name][key][0] if key in METRICS else summary[name][key]

  pairs = (("sasrec_ndcg_over_bpr", "embedlib sasrec", "RecBole BPR", "ndcg@10"),
           ("hstu_ndcg_over_sasrec", "embedlib hstu", "embedlib sasrec", "ndcg@10"))
  for ratio, a, b, key in pairs:
    if a in summary and b in summary:
      record.ratio(ratio, mean(a, key) / mean(b, key))
  if "embedlib sasrec" in summary and "RecBole SASRec" in summary:
    record.ratio("recbole_sasrec_epoch_over_ours", mean("RecBole SASRec", "s_per_epoch")
                 / mean("embedlib sasrec", "s_per_epoch"))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", required=True, help="RecBole's ML-100K folder (module docstring)")
  parser.add_argument("--seeds", default="2020,2021,2022")
  parser.add_argument("--models", default="sasrec,hstu,BPR,SASRec",
                      help="any of embedlib's sasrec, hstu and RecBole's BPR, SASRec; with "
                           "--reuse, also the labelled runs it holds, e.g. sasrec-masked")
  parser.add_argument("--recbole-budget-s", type=float, default=900.0)
  parser.add_argument("--steps", type=int, default=None,
                      help="embedlib training steps (default: the config's)")
  parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                      help="override a configs/movielens.py value for embedlib's runs, "
                           "e.g. --set batch_size=64 --set optim.dense.learning_rate=2e-3")
  parser.add_argument("--threads", type=int, default=2, help="torch threads for RecBole")
  parser.add_argument("--out", default=None, help="write every run's result here (JSON)")
  parser.add_argument("--label", default=None,
                      help="names embedlib's runs model-LABEL (e.g. 'masked' with "
                           "--set task.mask_seen=True), so they sit beside the plain ones")
  parser.add_argument("--reuse", default=None,
                      help="read the runs a previous --out folder holds instead of running them "
                           "(RecBole's SASRec takes its budget per seed)")
  parser.add_argument("--report-only", action="store_true",
                      help="with --reuse: report the runs it holds, run nothing")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--variant", help=argparse.SUPPRESS)
  parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--workdir", help=argparse.SUPPRESS)
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  if args.worker:
    return embedlib_worker(args)
  record = timing.Run("movielens", argv)

  seeds = [int(s) for s in args.seeds.split(",")]
  models = args.models.split(",")
  unknown = {m.split("-")[0] for m in models} - set(EMBEDLIB_MODELS) - set(RECBOLE_MODELS)
  if unknown:
    parser.error(f"--models: unknown {sorted(unknown)}; use {EMBEDLIB_MODELS + RECBOLE_MODELS}")
  have_peers = os.path.exists(PEER_PYTHON)
  if not have_peers:
    print("note: no .peers/ (run bash benchmarks/install_peers.sh): RecBole runs are skipped "
          "unless --reuse holds them.")
  runs: dict[str, list[dict]] = {}
  out = args.out or tempfile.mkdtemp(prefix="movielens_bench_")
  os.makedirs(out, exist_ok=True)
  split_file = os.path.join(out, "recbole_split.json")
  reused_split = os.path.join(args.reuse or out, "recbole_split.json")
  if os.path.exists(reused_split) and not os.path.exists(split_file):
    shutil.copy(reused_split, split_file)
  with tempfile.TemporaryDirectory() as workroot:
    for seed in seeds:
      for model in models:
        embedlib = model.split("-")[0] in EMBEDLIB_MODELS
        tag = model + (f"-{args.label}" if embedlib and args.label and "-" not in model else "")
        name = f"embedlib {tag}" if embedlib else f"RecBole {model}"
        file = f"{'embedlib' if embedlib else 'recbole'}_{tag}_{seed}.json"
        if args.reuse and os.path.exists(os.path.join(args.reuse, file)):
          with open(os.path.join(args.reuse, file), encoding="utf-8") as f:
            result = json.load(f)
          print(f"  {name} seed {seed}: from {args.reuse}")
        elif args.report_only:
          continue
        elif embedlib:
          result = run_embedlib(model.split("-")[0], seed, args, workroot)
        elif have_peers:
          first = not os.path.exists(split_file)
          result = run_recbole(model, seed, args, split_file if first else None)
        else:
          continue
        runs.setdefault(name, []).append(result)
        with open(os.path.join(out, file), "w", encoding="utf-8") as f:
          json.dump(result, f)
        record.probe()
  print(f"\nMovieLens-100K, leave-one-out, full ranking over all items; results in {out}")
  if os.path.exists(split_file):
    differ, users = compare_splits(args.data, split_file)
    print(f"split: {users - differ} of {users} users hold out the same validation and test "
          "item on both sides")
  seen = [dict(r, test=r["test_rank_seen"]) for r in runs.get("RecBole BPR", ())
          if "test_rank_seen" in r]
  if seen:  # the same BPR runs, tested on the sequential models' protocol
    runs[BPR_RANK_SEEN] = seen
  summary = {name: summarize(name, rs) for name, rs in runs.items()}
  print_table(list(summary.values()))
  print_targets(summary, runs, args.recbole_budget_s)
  record_figures(record, summary, runs)
  if args.reuse:
    record.note(f"runs read from {args.reuse} where it held them: their machine is not this one")
  record.finish(args.json)


if __name__ == "__main__":
  main()
