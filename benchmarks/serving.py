"""The exported int8 Criteo DLRM: peak memory against its bytes on disk, and CPU examples/s vs TorchRec.

    python benchmarks/serving.py                      # 26 tables of 100,000 rows
    python benchmarks/serving.py --rows 1000000       # the config's size (6.7 GB of float32)
    python benchmarks/serving.py --smoke              # tiny, seconds of work (tests)
    python benchmarks/serving.py --json run.json      # also the run's record (timing.Run)

One run, each step in a fresh process:

1. trains ``configs/dlrm_criteo.py`` (26 tables of ``--rows`` x 64, bottom
   MLP 13-512-256-64, top 512-256-1) for ``--steps`` steps of 1,024 on a
   planted Criteo-format file (``embedlib.data.criteo_synth``): the weights
   only need to exist, the figures don't depend on how well they fit;
2. ``python -m train.export --bits 8 --batch_size B``: its peak RSS;
3. ``embedlib.serving.load`` and one scored batch in a process that
   imports no model code: RSS after ``import jax``, after the load, and the
   peak, against the artifact's bytes on disk;
4. throughput: the loaded artifact (``ServedModel.__call__`` on numpy
   inputs: the input checks, the transfer and the program) and TorchRec's
   quantized inference DLRM (``benchmarks/peers/torchrec_serving.py``, int8
   rows, fp16 scale and bias, FBGEMM) score the same ``--batches`` batches of
   ``B`` examples, ``--rounds`` times each, interleaved; min / median / max
   examples/s per side, the ratio of medians and of the best runs. TorchRec's
   model holds the artifact's weights (its int8 tables dequantized, then
   quantized again by ``from_float``): the two sides' probabilities on the
   first batch are compared.

The ids are drawn per table from a Zipf(1.2) law over its rows (a hashed
Criteo column's skew), the dense features as ``log1p`` of counts.

``--json FILE`` keeps the run's record (``benchmarks/timing.py``): the
memory figures (MiB), each side's examples/s, and the named ratios
``vs_torchrec_quant`` (embedlib's median examples/s over TorchRec's, i.e.
TorchRec's time over ours), ``vs_torchrec_quant_best`` (the best runs') and
``load_peak_over_disk``, beside the machine's state (a copy probe after
each round).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "peers"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import numpy as np  # noqa: E402

import timing  # noqa: E402
import worker_protocol  # noqa: E402

PEER_PYTHON = os.path.join(ROOT, ".peers", "bin", "python")
NUM_TABLES, NUM_DENSE = 26, 13

# Run in a fresh process: memory of loading and scoring, with jax, numpy and
# embedlib.serving only (it imports neither flax nor the model code).
_LOAD = """
import json, sys, time
sys.path.insert(0, {root!r})
def rss(field):
  for line in open("/proc/self/status"):
    if line.startswith(field):
      return int(line.split()[1]) / 1024
import numpy as np, jax
import embedlib.serving
jax.numpy.zeros(1).block_until_ready()
out = {{"after_import": rss("VmRSS:")}}
start = time.perf_counter()
model = embedlib.serving.load({artifact!r})
out["load_s"] = time.perf_counter() - start
out["after_load"] = rss("VmRSS:")
data = np.load({data!r})
names = [n for n in model.input_names if n != "dense"]
inputs = {{"dense": data["dense"][0], **{{n: data["sparse"][0][:, i] for i, n in enumerate(names)}}}}
p = model(inputs)["probability"]
out["after_score"], out["peak"] = rss("VmRSS:"), rss("VmHWM:")
out["flax_imported"] = "flax" in sys.modules
out["mean_probability"] = float(p.mean())
print("@@load " + json.dumps(out))
"""


# Runs argv[2:] as a child of this small process and writes the child's peak
# RSS to argv[1]. A process forked straight from a large one (a test worker,
# a benchmark holding tables) starts with a copy of its pages, and Linux
# counts that copy's high-water mark in the exec'd child's ru_maxrss; forked
# from this one, the copy is a bare interpreter's.
_REAPER = """import os, sys
pid = os.fork()
if pid == 0:
  os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
  f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_child(argv, what, env=None) -> tuple[str, float, float]:
  """Runs ``argv`` from the repository root; ``(stdout, seconds, its peak RSS in MiB)``.

  The child is started and reaped (``wait4``, the one way to read a single
  child's ``ru_maxrss``) by a small Python process in between (``_REAPER``),
  so the peak is the child's own, not this process's size at the fork.
  """
  with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
      tempfile.NamedTemporaryFile("r") as peak:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _REAPER, peak.name, *argv], stdout=out,
                          stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT, env=env, check=False)
    seconds = time.perf_counter() - start
    out.seek(0)
    err.seek(0)
    if proc.returncode:
      raise RuntimeError(f"{what} failed (exit {proc.returncode}); the end of its stderr:\n"
                         f"{err.read()[-3000:]}")
    return out.read(), seconds, int(peak.read()) / 1024


def write_batches(path: str, num: int, batch: int, rows: int, seed: int = 0) -> None:
  """``num`` batches of ``batch`` examples: ``dense [num, batch, 13]``, ``sparse [..., 26]`` ids."""
  rng = np.random.default_rng(seed)
  ranks = rng.zipf(1.2, size=(num, batch, NUM_TABLES)).astype(np.uint64) - 1
  # A different hot row per table, as hashing spreads each column's values.
  offsets = np.arange(NUM_TABLES, dtype=np.uint64) * np.uint64(7919)
  sparse = ((ranks * np.uint64(2654435761) + offsets) % np.uint64(rows)).astype(np.int32)
  dense = np.log1p(rng.poisson(4.0, size=(num, batch, NUM_DENSE))).astype(np.float32)
  np.savez(path, dense=dense, sparse=sparse)


def train(workdir: str, rows: int, steps: int, lines: int, smoke: bool) -> None:
  """Trains configs/dlrm_criteo.py's model (``rows`` a table) into ``workdir`` (a child's job)."""
  from configs import dlrm_criteo  # pylint: disable=g-import-not-at-top
  from embedlib.data import criteo_synth  # pylint: disable=g-import-not-at-top
  from embedlib.training import train_lib  # pylint: disable=g-import-not-at-top

  config = dlrm_criteo.get_config("smoke" if smoke else None)
  path = os.path.join(workdir, "day.tsv")
  os.makedirs(workdir, exist_ok=True)
  criteo_synth.CriteoSynth(seed=0).write(path, lines)
  config.data.train_path, config.data.eval_holdout = path, 0.05
  if not smoke:
    config.data.table_sizes = (rows,) * NUM_TABLES
    config.batch_size = 1024
  config.num_train_steps = config.eval_every = config.checkpoint_every = steps
  config.eval_batches = 2
  train_lib.train_and_evaluate(config, os.path.join(workdir, "run"))


def jax_worker(artifact: str, data: str, dump: str | None = None) -> None:
  """Scores the batches of ``data`` with the loaded artifact on ``run`` requests (a child's job).

  ``dump``: where to save the first batch's probabilities (``.npy``).
  """
  import embedlib.serving  # pylint: disable=g-import-not-at-top

  model = embedlib.serving.load(artifact)
  arrays = np.load(data)
  names = [n for n in model.input_names if n != "dense"]
  batches = [{"dense": d, **{n: s[:, i] for i, n in enumerate(names)}}
             for d, s in zip(arrays["dense"], arrays["sparse"])]
  if dump:
    np.save(dump, model(batches[0])["probability"])
  position = [0]

  def run_steps(n):
    total = 0.0
    for _ in range(n):
      total = float(model(batches[position[0] % len(batches)])["probability"].mean())
      position[0] += 1
    return total

  first = run_steps(2)
  import jax  # pylint: disable=g-import-not-at-top

  worker_protocol.serve(run_steps, {"jax": jax.__version__, "first_mean": first})


def disk_bytes(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs)


def stats(values) -> str:
  v = sorted(values)
  return f"{v[0]:10,.0f} {v[len(v) // 2]:10,.0f} {v[-1]:10,.0f}"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=100_000, help="rows in each of the 26 tables")
  parser.add_argument("--steps", type=int, default=20, help="training steps of 1,024")
  parser.add_argument("--batch-size", type=int, default=2048, help="the exported program's batch")
  parser.add_argument("--batches", type=int, default=8, help="batches scored per timed run")
  parser.add_argument("--rounds", type=int, default=21, help="timed runs per side")
  parser.add_argument("--threads", type=int, default=2, help="TorchRec's torch threads")
  parser.add_argument("--tmp", default=None, help="where the workdir and artifact go")
  parser.add_argument("--smoke", action="store_true", help="configs/dlrm_criteo.py:smoke")
  parser.add_argument("--train-into", help=argparse.SUPPRESS)
  parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  if args.smoke:
    args.rows, args.steps, args.batch_size, args.batches, args.rounds = 1_000, 2, 32, 2, 2
  if args.train_into:
    # Enough lines for the steps, and for the 2 eval batches in the 5% held out.
    lines = 2_000 if args.smoke else max(args.steps * 1024 * 21 // 20, 2 * 1024 * 21)
    return train(args.train_into, args.rows, args.steps, lines, args.smoke)
  if args.serve:
    return jax_worker(*args.serve)

  record = timing.Run("serving", argv, smoke=args.smoke)
  python = sys.executable
  tmp = tempfile.mkdtemp(prefix="serving_bench_", dir=args.tmp)
  try:
    workdir, artifact, data = (os.path.join(tmp, n) for n in ("work", "int8", "batches.npz"))
    write_batches(data, args.batches, args.batch_size, args.rows)
    own = ["--rows", str(args.rows), "--steps", str(args.steps)] + (["--smoke"] * args.smoke)
    _, train_s, train_peak = run_child([python, __file__, "--train-into", workdir, *own],
                                       "training")
    _, export_s, export_peak = run_child(
        [python, "-m", "train.export", "--workdir", os.path.join(workdir, "run"), "--out",
         artifact, "--bits", "8", "--batch_size", str(args.batch_size)], "python -m train.export")
    shutil.rmtree(workdir)  # its checkpoint is the float32 tables: gone before the load
    out, load_wall, load_peak = run_child(
        [python, "-c", _LOAD.format(root=ROOT, artifact=artifact, data=data)], "loading")
    load = json.loads(out.split("@@load ", 1)[1].splitlines()[0])
    on_disk = disk_bytes(artifact)
    table_f32 = NUM_TABLES * args.rows * (8 if args.smoke else 64) * 4
    mib = 1 << 20
    print(f"\nconfigs/dlrm_criteo.py{':smoke' if args.smoke else ''}: 26 tables of "
          f"{args.rows:,} rows; trained {args.steps} steps ({train_s:.0f} s, peak "
          f"{train_peak:,.0f} MiB); exported int8 in {export_s:.0f} s (peak {export_peak:,.0f} MiB)")
    print(f"artifact on disk {on_disk / mib:,.1f} MiB (float32 tables would be "
          f"{table_f32 / mib:,.1f} MiB)")
    print(f"load + score one batch of {args.batch_size} in a fresh process ({load_wall:.1f} s, "
          f"flax imported: {load['flax_imported']}): RSS after import {load['after_import']:,.0f} "
          f"MiB, after load {load['after_load']:,.0f}, after scoring {load['after_score']:,.0f}, "
          f"peak {load['peak']:,.0f} MiB")
    print(f"peak / disk {load['peak'] * mib / on_disk:.2f}; (peak - after import) / disk "
          f"{(load['peak'] - load['after_import']) * mib / on_disk:.2f}")
    for name, value in (("training peak RSS", train_peak), ("export peak RSS", export_peak),
                        ("artifact on disk", on_disk / mib), ("RSS after import",
                                                              load["after_import"]),
                        ("RSS after load", load["after_load"]), ("load + score peak RSS",
                                                                 load["peak"])):
      record.add_case(name, value, "MiB")
    record.ratio("load_peak_over_disk", load["peak"] * mib / on_disk)
    throughput(args, python, artifact, data, record)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  record.finish(args.json)


def throughput(args, python, artifact, data, record) -> None:
  notes = []
  workers = []
  env = worker_protocol.peer_env(OMP_WAIT_POLICY="PASSIVE")
  dumps = [os.path.join(os.path.dirname(data), f"first_{side}.npy") for side in ("jax", "torch")]
  worker, info = worker_protocol.start_or_note(
      "embedlib int8 artifact", [python, __file__, "--serve", artifact, data, dumps[0]], env,
      notes)
  if worker:
    workers.append((worker, info))
  note = worker_protocol.missing_note(PEER_PYTHON)
  if note:
    notes.append(note)
  else:
    tables = ",".join([str(args.rows)] * NUM_TABLES)
    shape = ["--dim", "8", "--bottom", "16", "--top", "16,1"] if args.smoke else []
    worker, info = worker_protocol.start_or_note(
        "TorchRec quant EBC int8",
        [PEER_PYTHON, os.path.join(ROOT, "benchmarks", "peers", "torchrec_serving.py"),
         "--data", data, "--tables", tables, "--threads", str(args.threads), "--artifact",
         artifact, "--dump", dumps[1], *shape], env, notes)
    if worker:
      workers.append((worker, info))
  rates = {w.name: [] for w, _ in workers}
  try:
    for _ in range(args.rounds):
      for w, _ in workers:
        seconds = w.run(args.batches)["seconds"]
        rates[w.name].append(args.batches * args.batch_size / seconds)
      record.probe()
  finally:
    peaks = {w.name: w.close()["peak_rss_mib"] for w, _ in workers}
  print(f"\nscoring {args.batches} batches of {args.batch_size} per run, {args.rounds} runs "
        f"each, interleaved; examples/s")
  print(f"{'':28} {'min':>10} {'median':>10} {'max':>10} {'peak MiB':>9}")
  for w, info in workers:
    print(f"{w.name:28} {stats(rates[w.name])} {peaks[w.name]:9,.0f}")
  for w, info in workers:
    print(f"  {w.name}: {info}")
  if len(workers) == 2:
    medians = [sorted(rates[w.name])[len(rates[w.name]) // 2] for w, _ in workers]
    best = [max(rates[w.name]) for w, _ in workers]
    # On a shared machine the best run is the one least slowed by others.
    print(f"embedlib / TorchRec, medians: {medians[0] / medians[1]:.2f}; best runs: "
          f"{best[0] / best[1]:.2f}")
    record.ratio("vs_torchrec_quant", medians[0] / medians[1])
    record.ratio("vs_torchrec_quant_best", best[0] / best[1])
  record.add_times(rates, unit="examples/s")
  if all(os.path.exists(d) for d in dumps):
    diff = np.abs(np.load(dumps[0]) - np.load(dumps[1]))
    print(f"the two sides' probabilities on the first batch: max |diff| {diff.max():.2e}, "
          f"mean {diff.mean():.2e}")
  for note in notes:
    print(note)
    record.note(note)


if __name__ == "__main__":
  main()
