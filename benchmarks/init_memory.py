"""Peak host memory while building a sharded table, against a plain sharded jax.jit init.

    python3 benchmarks/init_memory.py                 # 0.25, 1 and 4 GiB tables
    python3 benchmarks/init_memory.py --sizes 0.25 1  # without the 4 GiB case (~6 GiB of RSS)
    python3 benchmarks/init_memory.py --dlrm          # configs/dlrm_criteo.py's start-up only
    python3 benchmarks/init_memory.py --quick         # tiny tables, a smoke run
    python3 benchmarks/init_memory.py --json run.json # also the run's record (timing.Run)

Each build runs in a fresh process on 8 simulated CPU devices, whose buffers
are this machine's memory: the process's peak resident set (``VmHWM``) above
its resident set after imports and mesh set-up, divided by the table's
bytes, is what building the table cost. Tables are built under
``jax.set_mesh`` (an Auto mesh), as flax's examples build their models.
Cases, for ``rows x 64`` f32 tables split by vocab rows and by hidden
columns over ``batch=8``:

- ``plain``: ``jax.jit(default_embed_init, out_shardings=...)``, the
  baseline; what an init that never holds the table whole costs;
- ``ShardedEmbed``: ``ShardedEmbed(rows, 64, sharding=...)``;
- ``EmbeddingCollection``: one ``TableSpec`` of that size.

Repeats (fresh processes) give min / median / max below 4 GiB; the 4 GiB
builds run once. Target: ShardedEmbed within 1.25x of plain. Every case,
plain included, peaks near 4x the table here: the 8 simulated devices draw
at once, each with its shard and three shards of temporaries. So a size is
skipped, with a note, when the machine has less than ~4.5x its bytes
available (the 4 GiB case needs ~19 GiB).

Before printing, every build is checked against the plain init of the same
seed: three whole rows bit for bit and the sum of absolute values (rtol
1e-5: sums of 16M+ entries in another order); at ``--quick`` sizes plain is
also checked against the eager ``default_embed_init``. A build that differs
is named and the script exits 1 without printing figures.

``--dlrm`` builds ``configs/dlrm_criteo.py``'s model and optimizer as
``embedlib.training.setup.model_and_optimizer`` does (26 tables of 1M x
64, row-wise AdaGrad) up to printing its plan, and reports the peak RSS against
the tables' bytes, and the constant: the RSS after imports.

``--json FILE`` keeps the run's record (``benchmarks/timing.py``): each
case's (peak - post-import RSS) / table bytes (unit ``x table``), the named
ratios ``sharded_over_plain_<size>_<layout>`` (medians) and
``worst_sharded_over_plain``, or with ``--dlrm`` ``dlrm_peak_over_tables``
and ``dlrm_peak_less_imports_over_tables``, beside the machine's state (a
copy probe after each size and layout's builds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import timing  # noqa: E402

FEATURES = 64
GiB = 1 << 30
CASES = ("plain", "ShardedEmbed", "EmbeddingCollection")
LAYOUTS = ("vocab", "hidden")
SAMPLE_ROWS = lambda rows: (0, rows // 3, rows - 1)  # noqa: E731


def _memory(field: str) -> int:
  """``VmHWM`` / ``VmRSS`` of this process, in bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"/proc/self/status has no {field}: this benchmark needs Linux.")


# -- workers (fresh processes) -------------------------------------------------


def _setup():
  sys.path.insert(0, ROOT)
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import AxisType  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
  jax.devices()
  return jax, mesh


def build_worker(case: str, layout: str, rows: int, seed: int) -> dict:
  """Builds one table; returns its memory figures and fingerprint."""
  jax, mesh = _setup()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from flax.nnx.nn.linear import default_embed_init  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import embedlib  # pylint: disable=g-import-not-at-top

  baseline = _memory("VmHWM")
  with jax.set_mesh(mesh):  # as flax's examples build their models
    if case == "plain":
      spec = P("batch", None) if layout == "vocab" else P(None, "batch")
      init = jax.jit(lambda key: default_embed_init(key, (rows, FEATURES), jnp.float32),
                     out_shardings=NamedSharding(mesh, spec))
      table = init(nnx.Rngs(seed).params())
    elif case == "ShardedEmbed":
      table = embedlib.ShardedEmbed(rows, FEATURES, layout=embedlib.Layout(sharding=layout),
                                    rngs=nnx.Rngs(seed)).logical_table()
    else:
      coll = embedlib.EmbeddingCollection(
          [embedlib.TableSpec("t", rows, FEATURES, sharding=layout)],
          [embedlib.FeatureSpec("f", "t")], rngs=nnx.Rngs(seed))
      table = coll.tables["t"].logical_table()
  table = jax.block_until_ready(table)
  peak = _memory("VmHWM")
  pick = jax.jit(lambda t: t[jnp.array(SAMPLE_ROWS(rows))], out_shardings=NamedSharding(mesh, P()))
  out = {"baseline": baseline, "peak": peak,
         "rows": np.asarray(pick(table)).tolist(),
         "abs_sum": float(jax.jit(lambda t: jnp.sum(jnp.abs(t)))(table))}
  if rows * FEATURES <= 1 << 20:  # small: the eager formula nnx.Embed evaluates
    eager = np.asarray(default_embed_init(nnx.Rngs(seed).params(), (rows, FEATURES), jnp.float32))
    out["eager_rows"] = eager[list(SAMPLE_ROWS(rows))].tolist()
  return out


def dlrm_worker() -> dict:
  """configs/dlrm_criteo.py's model and optimizer, as embedlib.training.setup builds them."""
  jax, _ = _setup()
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from configs import dlrm_criteo  # pylint: disable=g-import-not-at-top
  from embedlib.training import setup, tasks  # pylint: disable=g-import-not-at-top

  baseline = _memory("VmRSS")
  config = dlrm_criteo.get_config()
  mesh = setup.make_mesh(config)
  task = tasks.make_task(config)  # the model alone: no data files
  model, optimizer = setup.model_and_optimizer(config, task, task.data_spec(), mesh)
  plan = str(model.embeddings.plan)  # what the entrypoint logs before training
  jax.block_until_ready((nnx.state(model), nnx.state(optimizer)))
  tables = sum(t.plan.num_embeddings * t.plan.features * t.plan.itemsize
               for t in model.embeddings.tables.values())
  return {"baseline": baseline, "peak": _memory("VmHWM"), "tables": tables,
          "num_tables": len(model.embeddings.tables), "plan_lines": len(plan.splitlines())}


# -- the benchmark ---------------------------------------------------------------


def _env():
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", "")).strip()
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip())


def _run(argv) -> dict:
  done = subprocess.run([sys.executable, os.path.abspath(__file__)] + argv, env=_env(),
                        cwd=ROOT, capture_output=True, text=True, check=False)
  lines = [l for l in done.stdout.splitlines() if l.startswith("@@")]
  if done.returncode or not lines:
    killed = " (killed: out of memory?)" if done.returncode == -9 else ""
    raise RuntimeError(f"init_memory worker {argv} exited {done.returncode}{killed}:\n"
                       f"{done.stderr[-3000:]}")
  return json.loads(lines[-1][2:])


#: Host memory a build needs, in table bytes: the 8 simulated devices draw at
#: once, each holding its shard and three shards of temporaries (plain and
#: ShardedEmbed alike), plus room for the process.
NEED_TABLES, NEED_EXTRA = 4.5, 1 * GiB


def agree(results: dict, rtol: float = 1e-5) -> bool:
  """Whether every build equals the plain init of its size and layout.

  Args:
    results: ``(size, layout, case) -> [worker result, ...]``.

  Returns:
    False, after naming each build that differs, if any does.
  """
  ok = True
  for (size, layout, case), runs in results.items():
    want = results[(size, layout, "plain")][0]
    for got in runs:
      same = got["rows"] == want["rows"] and \
          abs(got["abs_sum"] - want["abs_sum"]) <= rtol * abs(want["abs_sum"])
      if "eager_rows" in want and case == "plain":
        same = same and got["rows"] == want["eager_rows"]
      if not same:
        print(f"init_memory: {case} ({_label(size)}, {layout}) differs from the plain init")
        ok = False
  return ok


def _rows_for(size_gib: float) -> int:
  rows = int(size_gib * GiB) // (FEATURES * 4)
  return max(8, rows - rows % 8)  # no padding: every case holds the same bytes


def _ratios(runs, table_bytes):
  return [(r["peak"] - r["baseline"]) / table_bytes for r in runs]


def _label(size_gib: float) -> str:
  return f"{size_gib:g} GiB" if size_gib >= 0.25 else f"{size_gib * 1024:g} MiB"


def _summary(values):
  return f"{min(values):6.2f} {statistics.median(values):6.2f} {max(values):6.2f}"


def tables(sizes, repeats, layouts=LAYOUTS, wrong_seed=None, record=None) -> bool:
  """Builds, checks, then prints every case (kept by ``record``); False if a build differs."""
  results, skipped = {}, []
  for size in sizes:
    rows = _rows_for(size)
    runs = repeats if size < 4 else 1
    need, free = NEED_TABLES * rows * FEATURES * 4 + NEED_EXTRA, timing.available_memory_bytes()
    if free < need:
      skipped.append(f"{_label(size)}: skipped, needs ~{need / GiB:.0f} GiB of available "
                     f"memory, {free / GiB:.0f} GiB available")
      continue
    for layout in layouts:
      for case in CASES:
        seed = 1 if case == wrong_seed else 0
        results[(size, layout, case)] = [
            _run(["--worker", case, layout, str(rows), str(seed)]) for _ in range(runs)]
      if record is not None:
        record.probe()
  if not agree(results):
    print("init_memory: a build differs from the plain init; no figures printed.")
    return False
  import jax  # pylint: disable=g-import-not-at-top  (the version, in this process)

  print(f"\npeak RSS above the post-import RSS / table bytes; rows x {FEATURES} f32 on 8 "
        f"simulated CPU devices, jax {jax.__version__}; min / median / max over "
        f"{repeats} fresh processes (4 GiB: 1)")
  print(f"{'table':>9s} {'layout':7s} {'case':20s} {'min':>6s} {'median':>6s} {'max':>6s}"
        "  median / plain")
  worst = 0.0
  for (size, layout, case), runs in results.items():
    rows = _rows_for(size)
    ratios = _ratios(runs, rows * FEATURES * 4)
    base = statistics.median(_ratios(results[(size, layout, "plain")], rows * FEATURES * 4))
    rel = statistics.median(ratios) / base
    if case == "ShardedEmbed":
      worst = max(worst, rel)
    print(f"{_label(size):>9s} {layout:7s} {case:20s} {_summary(ratios)}  {rel:6.2f}")
    if record is not None:
      record.add_case(f"{_label(size)} {layout}: {case}", ratios, "x table")
      if case == "ShardedEmbed":
        record.ratio(f"sharded_over_plain_{_label(size).replace(' ', '')}_{layout}", rel)
  for line in skipped:
    print(line)
  print(f"ShardedEmbed / plain, worst median: {worst:.2f} (target <= 1.25)")
  if record is not None:
    for line in skipped:
      record.note(line)
    record.ratio("worst_sharded_over_plain", worst)
  return True


def dlrm(record) -> None:
  r = _run(["--dlrm-worker"])
  t = r["tables"]
  print(f"\nconfigs/dlrm_criteo.py start-up to its plan ({r['num_tables']} tables, "
        f"{t / 1e9:.2f} GB; model and row-wise AdaGrad optimizer):")
  print(f"  peak RSS {r['peak'] / 1e9:.2f} GB = {r['peak'] / t:.2f} x tables; "
        f"RSS after imports {r['baseline'] / 1e9:.2f} GB; "
        f"(peak - that) / tables = {(r['peak'] - r['baseline']) / t:.2f} "
        f"(target: peak < 1.5 x tables + the RSS after imports)")
  record.add_case("dlrm: peak RSS", r["peak"] / GiB, "GiB")
  record.add_case("dlrm: RSS after imports", r["baseline"] / GiB, "GiB")
  record.add_case("dlrm: tables", t / GiB, "GiB")
  record.ratio("dlrm_peak_over_tables", r["peak"] / t)
  record.ratio("dlrm_peak_less_imports_over_tables", (r["peak"] - r["baseline"]) / t)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 1, 4],
                      help="table sizes in GiB")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
  parser.add_argument("--quick", action="store_true", help="tiny tables, one run each")
  parser.add_argument("--dlrm", action="store_true", help="only configs/dlrm_criteo.py")
  parser.add_argument("--wrong-seed", choices=CASES, help=argparse.SUPPRESS)  # tests the check
  parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
  parser.add_argument("--dlrm-worker", action="store_true", help=argparse.SUPPRESS)
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  if args.worker or args.dlrm_worker:
    case, layout, rows, seed = args.worker or (None,) * 4
    out = dlrm_worker() if args.dlrm_worker else build_worker(case, layout, int(rows), int(seed))
    print("@@" + json.dumps(out), flush=True)
    return 0
  record = timing.Run("init_memory", argv, smoke=args.quick)
  if args.dlrm:
    dlrm(record)
    record.finish(args.json)
    return 0
  sizes, repeats = ([1 / 1024], 1) if args.quick else (args.sizes, args.repeats)
  if not tables(sizes, repeats, args.layouts, args.wrong_seed, record):
    return 1
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
