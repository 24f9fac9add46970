"""EmbeddingCollection pooled lookups on a Criteo-like set of 26 tables, in one run.

    python3 benchmarks/collection_lookup.py             # --scale 0.05, batch 4096
    python3 benchmarks/collection_lookup.py --quick     # small sizes, a smoke run
    python3 benchmarks/collection_lookup.py --scale 1   # the full 10M-row table (7.1 GiB of tables)
    python3 benchmarks/collection_lookup.py --json run.json  # also the run's record (timing.Run)
    bash benchmarks/install_peers.sh                    # first, for the PyTorch columns

26 tables of 10 to 10M rows (times ``--scale``, at least 10 rows), widths 16
to 128, one feature each with bags of 1 to 32 ids (bag 1 is single-hot),
bag lengths uniform in [1, bag], ids Zipf(1.05) hashed over the table; every
feature pools with ``sum``. Each call takes the next of ``BATCHES`` such
batches (seeds 0, 1, ...; every case and worker cycles through the same
ones), so that a call finds the rows of a batch the calls before it did
not just fetch; ``--same-ids`` gives every call the first batch (the
protocol of the runs kept before 2026-12-07's fifth session). One device,
all jitted, interleaved repeats:

- ``take + segment_sum``: the baseline, a Python loop over the 26 tables
  of ``jnp.take`` then ``jax.ops.segment_sum`` in one jit;
- ``collection``: ``EmbeddingCollection(...)(ids)`` without dedup;
- ``collection, dedup``: the same with ``num_unique`` set to each table's
  measured need (rounded up to a multiple of 64);
- ``torchrec EmbeddingBagCollection``: TorchRec's collection (one
  ``nn.EmbeddingBag`` per table, sum pooling) on the same tables (the JAX
  collection's values), ids and bags (a ``KeyedJaggedTensor`` with the -1
  padding removed), forward only under ``torch.no_grad()``;
- ``fbgemm table-batched``: FBGEMM's CPU table-batched kernel
  (``SplitTableBatchedEmbeddingBagsCodegen``, one op for the 26 tables) on
  the same; ``--no-fbgemm`` leaves it out.

The PyTorch columns run in the ``.peers`` venv, each in its own long-lived
worker (``benchmarks/peers/torchrec_collection.py``, the line protocol of
``benchmarks/peers/worker_protocol.py``), reading the tables and padded ids
from one temporary ``.npz`` (each worker holds its own copy of the tables).
Their pooled outputs are checked equal to the baseline's (to 1e-5) before
any timing; they run with ``--torch-threads`` threads (default 2) and
``OMP_WAIT_POLICY=PASSIVE`` (PEERS.md: it steadies 2-thread timings, and
keeps an idle worker's threads from spinning while JAX is timed). A worker
times its own forward (no pipe latency); every round shuffles the order of the
cases (seeded). One timed sample is ``--inner`` calls back to back (default
8), a worker's as many of its forwards, reported per call: a call timed
alone, after the process slept through a worker's turn, pays the machine's
wake-up (``benchmarks/README.md``, "One step timed alone"; the runs kept
before 2026-12-07's sixth session timed one call, ``--inner 1``). Without
``.peers/`` the PyTorch columns are skipped with a note.

Prints min / median / max ms and the ratio of medians to the baseline
(target <= 1.0), dedup's cost (the collection with dedup over the one
without, from one interleaving: target <= 1.5) and the named ratios beside the
machine's state (``record_ratios``; ``--json``'s record, ``benchmarks/timing.py``),
then the collection's plan on a simulated 8-device
``batch`` mesh with the bytes each device receives per step, with and
without dedup (capacities measured per data shard of this batch). Never
asserts a time."""

import argparse
import math
import os
import random
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)
sys.path.insert(2, os.path.join(HERE, "peers"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from embedlib import CollectionLayout, EmbeddingCollection, FeatureSpec, TableSpec  # noqa: E402
from embedlib.collection import plan_collection  # noqa: E402
from embedlib.plan import cost  # noqa: E402
from embedlib.plan.report import human_bytes  # noqa: E402
import timing  # noqa: E402
from timing import interleaved, print_table  # noqa: E402
from worker_protocol import cycle, missing_note, peer_env, sample_ms, start_or_note  # noqa: E402

#: Rows of the 26 tables, Criteo-like: a few huge ones, a long tail of small.
ROWS = (
    10_000_000, 5_000_000, 3_000_000, 2_000_000, 1_000_000, 600_000, 300_000,
    100_000, 50_000, 25_000, 10_000, 5_000, 3_000, 2_000, 1_000, 600, 300,
    150, 100, 60, 30, 20, 15, 12, 10, 10,
)
WIDTHS = (128, 64, 32, 16)
BAGS = (1, 32, 1, 8, 16, 1, 4, 2, 24, 1, 12, 1)
PLAN_DEVICES = 8
PEER_PYTHON = os.path.join(ROOT, ".peers", "bin", "python")
TORCH_SCRIPT = os.path.join(HERE, "peers", "torchrec_collection.py")
EBC, TBE = "torchrec EmbeddingBagCollection (CPU)", "fbgemm table-batched (CPU)"
PEERS = {EBC: "ebc", TBE: "fbgemm"}  # column -> worker --variant
BASE, COLLECTION, DEDUP = "take + segment_sum (loop of 26)", "collection", "collection, dedup"
TOLERANCE = 1e-5
#: The batches of ids a run's calls cycle through.
BATCHES = 16


def specs(scale):
  tables, features = [], []
  for i, rows in enumerate(ROWS):
    name = f"C{i + 1}"
    tables.append(TableSpec(
        name, max(10, int(rows * scale)), WIDTHS[i % len(WIDTHS)],
        initializer=jax.nn.initializers.uniform(0.05),
    ))
    bag = BAGS[i % len(BAGS)]
    features.append(FeatureSpec(name, name, max_ids_per_sample=bag))
  return tables, features


def make_ids(tables, features, batch, seed=0):
  """Padded Zipf bags per feature (numpy); single-hot features are ``[batch]``."""
  rng = np.random.default_rng(seed)
  out = {}
  for t, f in zip(tables, features):
    bag = f.max_ids_per_sample
    # Zipf ranks hashed over the table (multiplicative hash: hot ids spread out).
    ids = ((rng.zipf(1.05, (batch, bag)) - 1) * 2654435761) % t.num_embeddings
    if bag == 1:
      out[f.name] = ids[:, 0].astype(np.int32)
      continue
    lengths = rng.integers(1, bag + 1, batch)
    ids[np.arange(bag)[None, :] >= lengths[:, None]] = -1
    out[f.name] = ids.astype(np.int32)
  return out


def baseline_fn(features, batch):
  """The loop of ``jnp.take`` + ``segment_sum`` over every table."""

  def run(tables, ids):
    out = {}
    for f in features:
      x = ids[f.name].reshape(batch, -1)
      flat = x.reshape(-1)
      valid = flat >= 0
      rows = jnp.take(tables[f.table], jnp.where(valid, flat, 0), axis=0)
      rows = jnp.where(valid[:, None], rows, 0)
      seg = jnp.repeat(jnp.arange(batch), x.shape[1])
      out[f.name] = jax.ops.segment_sum(rows, seg, batch, indices_are_sorted=True)
    return out

  return jax.jit(run)


def collection_fn(coll):
  graphdef, state = nnx.split(coll)
  return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)), state


def shard_needs(features, ids, shards):
  """Distinct valid ids per data shard, the max over shards, per table."""
  needs = {}
  for f in features:
    x = ids[f.name].reshape(ids[f.name].shape[0], -1)
    per = [len(np.unique(s[s >= 0])) for s in np.array_split(x, shards)]
    needs[f.table] = max(per)
  return needs


def cycling(fn, first, batches):
  """``(call, ())`` for ``timing``'s cases: each call is ``fn(first, batch)`` on the next
  batch, in the order the PyTorch workers take them (``worker_protocol.cycle``)."""
  take = cycle(batches)
  return (lambda: fn(first, take())), ()


def start_peers(args, tmp, features, logical, batches_np, want):
  """Starts the PyTorch workers; returns ``(workers, notes)``.

  Writes the tables and every batch's padded ids once to ``tmp/ids.npz``;
  every worker reads it, builds its module, writes one forward's pooled
  outputs (the first batch's), which are checked against ``want`` (the
  baseline's on it) here, and warms up.

  Args:
    batches_np: the batches, each feature name -> padded ids.
  """
  missing = missing_note(args.peer_python)
  if missing:
    return {}, [missing]
  names = [f.name for f in features]
  data = os.path.join(tmp, "ids.npz")
  np.savez(data, names=np.array(names), batches=np.array(len(batches_np)),
           **{f"w_{f.name}": np.asarray(logical[f.table]) for f in features},
           **{f"ids_{n}": np.stack([b[n] for b in batches_np]) for n in names})
  env = peer_env(OMP_WAIT_POLICY="PASSIVE")
  workers, notes = {}, []
  for col, variant in PEERS.items():
    if variant == "fbgemm" and not args.fbgemm:
      continue
    check = os.path.join(tmp, f"out_{variant}.npz")
    w, info = start_or_note(
        col, [args.peer_python, TORCH_SCRIPT, "--data", data, "--variant", variant,
              "--threads", str(args.torch_threads), "--check", check], env, notes)
    if w is None:
      continue
    got = np.load(check)
    err = max(float(np.max(np.abs(got[f"out_{n}"] - np.asarray(want[n])))) for n in names)
    print(f"  {col}: " + ", ".join(
        f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
          + f"; max |{variant} - baseline| = {err:.2e}")
    if not err <= TOLERANCE:
      w.kill()
      for other in workers.values():
        other.kill()
      raise SystemExit(f"{col}: pooled outputs differ from the baseline by {err:.2e} "
                       f"(> {TOLERANCE})")
    workers[col] = w
  return workers, notes


def interleaved_with_workers(cases, workers, repeats, between_rounds=None, calls=1):
  """``timing.interleaved`` plus worker cases, the order shuffled each round.

  JAX cases are timed here (``timing.time_calls``); a worker times its own
  forward. A sample is ``calls`` calls back to back, a worker's ``calls`` of
  its forwards, reported per call.
  A seeded shuffle, not a rotation: rotating a cyclic order keeps every
  case behind the same predecessor, whose cache footprint it inherits.
  ``between_rounds`` is called after every round (the run's copy probe).
  """
  for fn, a in cases.values():
    jax.block_until_ready(fn(*a))
  names = list(cases) + list(workers)
  times = {name: [] for name in names}
  rng = random.Random(0)
  for _ in range(repeats):
    order = names[:]
    rng.shuffle(order)
    for name in order:
      if name in cases:
        fn, a = cases[name]
        times[name].append(timing.time_calls(fn, a, calls))
      else:
        times[name].append(sample_ms(workers[name], calls))
    if between_rounds is not None:
      between_rounds()
  return times


def record_ratios(record, times, dedup_times):
  """The named ratios, by medians: ``vs_fbgemm_tbe`` and ``vs_torchrec_ebc``
  (the peer's forward time over the collection's), ``collection_over_take``
  (the collection's over the baseline's, target <= 1) and
  ``dedup_over_collection`` (dedup's cost, its own interleaving, target <= 1.5)."""
  for name, col in (("vs_fbgemm_tbe", TBE), ("vs_torchrec_ebc", EBC)):
    if col in times:
      record.ratio(name, timing.median_ratio(times[col], times[COLLECTION]))
    else:
      record.note(f"no {col} column, so no {name}")
  record.ratio("collection_over_take", timing.median_ratio(times[COLLECTION], times[BASE]))
  record.ratio("dedup_over_collection",
               timing.median_ratio(dedup_times[DEDUP], dedup_times[COLLECTION]))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=0.05,
                      help="rows of each table times this (1 = up to 10M rows)")
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
  parser.add_argument("--torch-threads", type=int, default=2,
                      help="threads of the PyTorch workers (OMP_WAIT_POLICY=PASSIVE)")
  parser.add_argument("--no-fbgemm", dest="fbgemm", action="store_false",
                      help="leave out the FBGEMM table-batched column")
  parser.add_argument("--same-ids", action="store_true",
                      help="every call on the first batch of ids (the protocol of runs kept "
                           "before 2026-12-07's fifth session)")
  timing.add_inner_argument(parser, since="2026-12-07's sixth session")
  parser.add_argument("--peer-python", default=PEER_PYTHON,
                      help="python of the peer venv (default .peers/bin/python)")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  timing.check_inner(parser, args.inner)
  record = timing.Run("collection_lookup", argv, smoke=args.quick)
  scale, batch = (0.001, 256) if args.quick else (args.scale, args.batch)
  repeats = args.repeats or (3 if args.quick else 15)
  tables, features = specs(scale)
  total = sum(t.num_embeddings * t.features * 4 for t in tables)
  print(f"jax {jax.__version__}, {jax.default_backend()}, {len(jax.devices())} device(s); "
        f"26 tables, {human_bytes(total)} f32, largest {tables[0].num_embeddings} rows; "
        f"batch {batch}, {sum(f.max_ids_per_sample for f in features)} id slots per sample")
  print(f"{os.cpu_count()} CPUs; XLA_FLAGS={os.environ.get('XLA_FLAGS', '(unset)')!r}")

  start = time.perf_counter()
  coll = EmbeddingCollection(tables, features, rngs=nnx.Rngs(0))
  batches_np = [make_ids(tables, features, batch, seed=seed)
                for seed in range(1 if args.same_ids else BATCHES)]
  ids_np = batches_np[0]
  batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in batches_np]
  ids = batches[0]
  record.note("the first batch of ids every call (--same-ids)" if args.same_ids else
              f"{len(batches)} batches of ids, each call the next")
  needs_per_batch = [shard_needs(features, b, 1) for b in batches_np]
  needs = needs_per_batch[0]
  # Dedup's capacity: each table's most distinct ids in any of the batches.
  caps = {name: 64 * math.ceil(max(n[name] for n in needs_per_batch) / 64) for name in needs}
  dedup = EmbeddingCollection(tables, features, layout=CollectionLayout(num_unique=caps),
                              rngs=nnx.Rngs(0))
  nnx.update(dedup, nnx.state(coll, nnx.Param))  # one set of tables stays alive
  logical = {t.name: coll.tables[t.name].embedding[...] for t in tables}
  print(f"built in {time.perf_counter() - start:.1f} s; distinct ids per step "
        f"{sum(needs.values())} of {sum(int((v >= 0).sum()) for v in ids_np.values())}")

  run_coll, state = collection_fn(coll)
  run_dedup, dedup_state = collection_fn(dedup)
  base = baseline_fn(features, batch)
  # Same tables for all three, so the outputs must agree.
  want, got = base(logical, ids), run_coll(state, ids)
  got_dedup = run_dedup(dedup_state, ids)
  err = max(float(jnp.max(jnp.abs(got[k] - want[k]))) for k in want)
  err_dedup = max(float(jnp.max(jnp.abs(got_dedup[k] - want[k]))) for k in want)
  print(f"max |collection - baseline| = {err:.2e}, with dedup {err_dedup:.2e}")

  base_name = BASE
  cases = {
      base_name: cycling(base, logical, batches),
      COLLECTION: cycling(run_coll, state, batches),
  }
  with tempfile.TemporaryDirectory(prefix="collection_lookup_") as tmp:
    start = time.perf_counter()
    workers, notes = start_peers(args, tmp, features, logical, batches_np, want)
    if workers:
      print(f"PyTorch workers built and warmed up in {time.perf_counter() - start:.0f} s")
    try:
      times = interleaved_with_workers(cases, workers, repeats, between_rounds=record.probe,
                                       calls=args.inner)
      rss = {name: w.close()["peak_rss_mib"] for name, w in workers.items()}
    finally:
      for w in workers.values():
        w.kill()
  print_table(times, base_name, f"one device, {repeats} interleaved repeats, ms")
  for note in notes:
    print(note)
  for name in workers:
    print(f"{name}: worker peak RSS {rss[name]:.0f} MiB; baseline / it (medians) "
          f"{statistics.median(times[base_name]) / statistics.median(times[name]):.1f}x, "
          f"collection / it {timing.median_ratio(times[COLLECTION], times[name]):.1f}x")
  # Dedup in its own interleaving (a case's cache footprint skews the next
  # one), the collection without dedup beside it: their ratio is dedup's cost.
  dedup_times = interleaved(
      {base_name: cases[base_name], COLLECTION: cases[COLLECTION],
       DEDUP: cycling(run_dedup, dedup_state, batches)},
      repeats, between_rounds=record.probe, calls=args.inner,
  )
  record.add_times(times)
  record.add_times(dedup_times, prefix="dedup interleaving: ")
  record_ratios(record, times, dedup_times)
  print_table(dedup_times, base_name, f"dedup, {repeats} interleaved repeats, ms")
  plain, deduped = dedup_times[COLLECTION], dedup_times[DEDUP]
  print(f"dedup / collection (this interleaving): median "
        f"{statistics.median(deduped) / statistics.median(plain):.2f}, min "
        f"{min(deduped) / min(plain):.2f}  (target <= 1.5)")

  mesh = {"batch": PLAN_DEVICES}
  shard_caps = shard_needs(features, ids_np, PLAN_DEVICES)
  plan = plan_collection(tables, features, mesh=mesh, batch_size=batch, num_unique=shard_caps)
  print(f"\nplan on {PLAN_DEVICES} devices (dedup capacity = distinct ids per data shard "
        f"of this batch):")
  print(plan)
  without = sum(t.bytes_moved for t in plan.tables)
  with_best = sum(min(t.bytes_moved, t.bytes_moved_dedup) for t in plan.tables)
  ids_per_shard = {f.table: int((ids_np[f.name] >= 0).sum()) // PLAN_DEVICES for f in features}
  pays = [t for t in plan.tables if t.bytes_moved_dedup is not None and cost.dedup_pays(
      t.bytes_moved, t.bytes_moved_dedup, ids_per_shard[t.name])]
  with_paying = without - sum(t.bytes_moved - t.bytes_moved_dedup for t in pays)
  print(f"bytes received per device per step: {human_bytes(without)} without dedup, "
        f"{human_bytes(plan.bytes_moved)} with dedup on every table, {human_bytes(with_best)} with "
        f"dedup only where it moves less, {human_bytes(with_paying)} with dedup only where the "
        f"bytes it saves pay for its work (cost.dedup_pays, {cost.DEDUP_BYTES_PER_ID} bytes an "
        f"id: {', '.join(t.name for t in pays) or 'no table'})")
  for name, ts in ((COLLECTION, times), (DEDUP, dedup_times)):
    print(f"{name} / baseline: median "
          f"{statistics.median(ts[name]) / statistics.median(ts[base_name]):.2f}, "
          f"min {min(ts[name]) / min(ts[base_name]):.2f}")
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(f"peak RSS {human_bytes(peak)}")
  record.finish(args.json)


if __name__ == "__main__":
  main()
