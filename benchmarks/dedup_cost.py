"""Dedup's cost against the bytes it saves: one routed table on 8 simulated CPU devices.

    python3 benchmarks/dedup_cost.py                 # 15 interleaved repeats, about a minute
    python3 benchmarks/dedup_cost.py --repeats 5

The calibration of ``embedlib.plan.cost.DEDUP_BYTES_PER_ID``: a collection
of one ``sharding="routed"`` table (64 wide) read by one pooled feature
(bags of 8, batch 4096: 4,096 ids a shard) on a ``batch`` mesh of 8
simulated CPU devices, with and without dedup (``num_unique`` = the most
distinct ids any shard holds), for three id sets: uniform over 100,000 rows
(few repeats), Zipf(1.05) over 100,000 rows, uniform over 2,000 rows (many
repeats). Prints the planner's bytes received per device either way, the
bytes saved per id, whether ``cost.dedup_pays`` turns dedup on, and min /
median / max ms of the forward from one interleaved run. The simulated
devices share the machine's cores: the times weigh dedup's work against
the collectives' copies on this CPU, not a GPU's. Never asserts a time.
"""

import argparse
import os
import statistics
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from embedlib import EmbeddingCollection, FeatureSpec, TableSpec  # noqa: E402
from embedlib.plan import cost  # noqa: E402
from timing import interleaved, print_table  # noqa: E402

BATCH, BAG, WIDTH, DEVICES = 4096, 8, 64, 8
SETS = ((100_000, "uniform"), (100_000, "zipf"), (2_000, "uniform"))


def make_ids(rows, kind, rng):
  if kind == "uniform":
    return rng.integers(0, rows, (BATCH, BAG)).astype(np.int32)
  return (((rng.zipf(1.05, (BATCH, BAG)) - 1) * 2654435761) % rows).astype(np.int32)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args()
  mesh = jax.make_mesh((DEVICES,), ("batch",))
  split = jax.NamedSharding(mesh, jax.P("batch"))
  rng = np.random.default_rng(0)
  cases, first, choices = {}, None, []
  print(f"{DEVICES} simulated devices, batch {BATCH}, bags of {BAG}, width {WIDTH}; "
        f"load average {os.getloadavg()[0]:.1f} at start")
  for rows, kind in SETS:
    ids = make_ids(rows, kind, rng)
    need = max(len(np.unique(s)) for s in np.array_split(ids, DEVICES))
    tables = [TableSpec("t", rows, WIDTH, sharding="routed")]
    features = [FeatureSpec("f", "t", max_ids_per_sample=BAG)]
    x = {"f": jax.device_put(ids, split)}
    for capacity in (None, need):
      coll = EmbeddingCollection(tables, features, mesh=mesh, num_unique=capacity,
                                 batch_size=BATCH, rngs=nnx.Rngs(0))
      graphdef, state = nnx.split(coll)
      fn = jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x))
      name = f"{kind} over {rows:,} rows, " + (f"dedup at {need}" if capacity else "no dedup")
      cases[name] = (fn, (state, x))
      first = first or name
    t = coll.plan.tables[0]
    per_id = (t.bytes_moved - t.bytes_moved_dedup) / (BATCH // DEVICES * BAG)
    pays = cost.dedup_pays(t.bytes_moved, t.bytes_moved_dedup, BATCH // DEVICES * BAG)
    choices.append((list(cases)[-2], list(cases)[-1], pays))
    print(f"{kind} over {rows:,} rows: {need} distinct ids a shard; received per device "
          f"{t.bytes_moved:,} B without dedup, {t.bytes_moved_dedup:,} B with: {per_id:.0f} B "
          f"saved an id; dedup_pays: {pays}")
  times = interleaved(cases, args.repeats)
  print_table(times, first, f"forward, {DEVICES} simulated devices, {args.repeats} "
              "interleaved repeats, ms")
  for plain, dedup, pays in choices:
    ratio = statistics.median(times[dedup]) / statistics.median(times[plain])
    chosen = "dedup" if pays else "no dedup"
    faster = "dedup" if ratio < 1 else "no dedup"
    print(f"{plain.rsplit(',', 1)[0]}: dedup / no dedup (medians) {ratio:.2f}; "
          f"cost.dedup_pays chooses {chosen}, measured faster: {faster}")
  print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
  main()
