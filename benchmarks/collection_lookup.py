"""EmbeddingCollection pooled lookups on a Criteo-like set of 26 tables, in one run.

    python3 benchmarks/collection_lookup.py             # --scale 0.05, batch 4096
    python3 benchmarks/collection_lookup.py --quick     # small sizes, a smoke run
    python3 benchmarks/collection_lookup.py --scale 1   # the full 10M-row table (~5 GiB)

26 tables of 10 to 10M rows (times ``--scale``, at least 10 rows), widths 16
to 128, one feature each with bags of 1 to 32 ids (bag 1 is single-hot),
bag lengths uniform in [1, bag], ids Zipf(1.05) hashed over the table; every
feature pools with ``sum``. One device, all jitted, interleaved repeats:

- ``take + segment_sum``: the baseline, a Python loop over the 26 tables
  of ``jnp.take`` then ``jax.ops.segment_sum`` in one jit;
- ``collection``: ``EmbeddingCollection(...)(ids)`` without dedup;
- ``collection, dedup``: the same with ``num_unique`` set to each table's
  measured need (rounded up to a multiple of 64);
- ``torchrec EmbeddingBagCollection``: on CPU, only when torch and torchrec
  import (else the column is reported as skipped).

Prints min / median / max ms and the ratio of medians to the baseline
(target <= 1.0), then the collection's plan on a simulated 8-device
``batch`` mesh with the bytes each device receives per step, with and
without dedup (capacities measured per data shard of this batch). Never
asserts a time.
"""

import argparse
import math
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from embedlib import EmbeddingCollection, FeatureSpec, TableSpec  # noqa: E402
from embedlib.collection import plan_collection  # noqa: E402
from embedlib.plan.embedding_plan import _human  # noqa: E402
from timing import interleaved, print_table  # noqa: E402

#: Rows of the 26 tables, Criteo-like: a few huge ones, a long tail of small.
ROWS = (
    10_000_000, 5_000_000, 3_000_000, 2_000_000, 1_000_000, 600_000, 300_000,
    100_000, 50_000, 25_000, 10_000, 5_000, 3_000, 2_000, 1_000, 600, 300,
    150, 100, 60, 30, 20, 15, 12, 10, 10,
)
WIDTHS = (128, 64, 32, 16)
BAGS = (1, 32, 1, 8, 16, 1, 4, 2, 24, 1, 12, 1)
PLAN_DEVICES = 8


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


def torchrec_case(tables, features, ids):
  """``(fn, args)`` for TorchRec's EmbeddingBagCollection, or a reason it's skipped."""
  try:
    import torch  # noqa: PLC0415
    import torchrec  # noqa: PLC0415
  except ImportError as e:
    return None, f"torch/torchrec not importable ({e.name})"
  configs = [
      torchrec.EmbeddingBagConfig(
          name=t.name, embedding_dim=t.features, num_embeddings=t.num_embeddings,
          feature_names=[f.name], pooling=torchrec.PoolingType.SUM,
      )
      for t, f in zip(tables, features)
  ]
  ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
  values, lengths = [], []
  for f in features:
    x = ids[f.name].reshape(ids[f.name].shape[0], -1)
    values.append(torch.from_numpy(x[x >= 0].astype(np.int64)))
    lengths.append(torch.from_numpy((x >= 0).sum(1).astype(np.int64)))
  kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
      keys=[f.name for f in features], values=torch.cat(values), lengths=torch.cat(lengths)
  )

  def run():
    with torch.no_grad():
      ebc(kjt).values()

  return (run, ()), None


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--scale", type=float, default=0.05,
                      help="rows of each table times this (1 = up to 10M rows)")
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
  args = parser.parse_args()
  scale, batch = (0.001, 256) if args.quick else (args.scale, args.batch)
  repeats = args.repeats or (3 if args.quick else 15)
  tables, features = specs(scale)
  total = sum(t.num_embeddings * t.features * 4 for t in tables)
  print(f"jax {jax.__version__}, {jax.default_backend()}, {len(jax.devices())} device(s); "
        f"26 tables, {_human(total)} f32, largest {tables[0].num_embeddings} rows; "
        f"batch {batch}, {sum(f.max_ids_per_sample for f in features)} id slots per sample")

  start = time.perf_counter()
  coll = EmbeddingCollection(tables, features, rngs=nnx.Rngs(0))
  ids_np = make_ids(tables, features, batch)
  ids = {k: jnp.asarray(v) for k, v in ids_np.items()}
  needs = shard_needs(features, ids_np, 1)
  caps = {name: 64 * math.ceil(n / 64) for name, n in needs.items()}
  dedup = EmbeddingCollection(tables, features, num_unique=caps, rngs=nnx.Rngs(0))
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

  base_name = "take + segment_sum (loop of 26)"
  cases = {
      base_name: (base, (logical, ids)),
      "collection": (run_coll, (state, ids)),
  }
  torch_case, skipped = torchrec_case(tables, features, ids_np)
  if torch_case is not None:
    cases["torchrec EmbeddingBagCollection (CPU)"] = torch_case
  times = interleaved(cases, repeats)
  print_table(times, base_name, f"one device, {repeats} interleaved repeats, ms")
  if skipped:
    print(f"torchrec EmbeddingBagCollection: skipped, {skipped}")
  # Dedup in its own interleaving: a case's cache footprint skews the next one.
  dedup_times = interleaved(
      {base_name: cases[base_name], "collection, dedup": (run_dedup, (dedup_state, ids))},
      repeats,
  )
  print_table(dedup_times, base_name, f"dedup, {repeats} interleaved repeats, ms")

  mesh = {"batch": PLAN_DEVICES}
  shard_caps = shard_needs(features, ids_np, PLAN_DEVICES)
  plan = plan_collection(tables, features, mesh=mesh, batch_size=batch, num_unique=shard_caps)
  print(f"\nplan on {PLAN_DEVICES} devices (dedup capacity = distinct ids per data shard "
        f"of this batch):")
  print(plan)
  without = sum(t.bytes_moved for t in plan.tables)
  with_best = sum(min(t.bytes_moved, t.bytes_moved_dedup) for t in plan.tables)
  print(f"bytes received per device per step: {_human(without)} without dedup, "
        f"{_human(plan.bytes_moved)} with dedup on every table, {_human(with_best)} with "
        f"dedup only where it moves less")
  for name, ts in (("collection", times), ("collection, dedup", dedup_times)):
    print(f"{name} / baseline: median "
          f"{statistics.median(ts[name]) / statistics.median(ts[base_name]):.2f}, "
          f"min {min(ts[name]) / min(ts[base_name]):.2f}")
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(f"peak RSS {_human(peak)}")


if __name__ == "__main__":
  main()
