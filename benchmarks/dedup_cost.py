"""Dedup's cost against the bytes it saves, 8 simulated CPU devices: one table or a collection.

    python3 benchmarks/dedup_cost.py                 # 15 interleaved repeats, about a minute
    python3 benchmarks/dedup_cost.py --repeats 5
    python3 benchmarks/dedup_cost.py --collection    # the 26-table collection, --scale 0.05
    python3 benchmarks/dedup_cost.py --json run.json # also the run's record (timing.Run)

The calibration of ``embedlib.plan.cost.DEDUP_BYTES_PER_ID``: a collection
of one ``sharding="routed"`` table (64 wide) read by one pooled feature
(bags of 8, batch 4096: 4,096 ids a shard) on a ``batch`` mesh of 8
simulated CPU devices, with and without dedup (``num_unique`` = the most
distinct ids any shard holds), for five id sets: uniform over 100,000,
20,000 and 10,000 rows (few to more repeats), Zipf(1.05) over 100,000
rows, uniform over 2,000 rows (many repeats). Prints the planner's bytes
received per device either way, the bytes saved per id, whether
``cost.dedup_pays`` turns dedup on, and min / median / max ms of the
forward, then of the forward + backward (as ``--collection``'s; a
training step's), each from one interleaved run. The simulated
devices share the machine's cores: the times weigh dedup's work against
the collectives' copies on this CPU, not a GPU's. Never asserts a time.
A sample is ``--inner`` calls back to back (default 8; 1 before 2026-12-07's
eighth session), in ms a call: one call timed alone pays the machine's
wake-up (``benchmarks/README.md``, "One step timed alone").

``--collection`` weighs the planner's choice on a whole collection: the
26 Criteo-like tables of ``collection_lookup.py`` (its tables, features and
Zipf ids, rows times ``--scale``), batch ``--batch``, on the same mesh, each
table's ``id_skew`` fitted to the batch (``fit_id_skews``; ``--uniform``
plans for uniform ids instead), as

- the plan's choice (``num_unique="auto"``; prints which tables it dedups);
- the same plan built again: the same program, the run's noise control;
- the other choice, table by table: the plan's layouts, each sharded
  table's dedup turned off where the plan dedups and on where it doesn't
  (at the capacity the planner gives a forced dedup, ``cost.dedup_capacity``
  of the table's ids and skew: what a user who overrides ``auto`` gets);
- dedup on every table the plan shards, at those capacities (the planner
  may then lay them out otherwise; a replicated table moves no bytes, so
  its dedup would be work alone);
- dedup on none.

Each case prints, for the tables it dedups, the bytes dedup saves an id at
its capacity and which of them ``cost.dedup_pays`` accepts; the shards'
measured distinct ids are printed beside the planned capacities. Named
ratios (medians; printed beside the machine's state and kept by ``--json``,
``benchmarks/timing.py``): ``dedup_over_none_<ids>_<forward|backward>`` for
the one-table sets (``uniform_100k``, ``zipf_100k``, ...), and
``<variant>_over_plan_<forward|backward>`` for ``--collection``
(``control``, ``other_choice``, ``dedup_all``, ``dedup_none``).
Their pooled outputs are checked equal (to 1e-5), then one interleaving
times the forwards and another the forwards + backwards (the pooled
outputs' sum through ``optim.value_and_grad``: gradients for the rows
looked up, as a training step takes them, before the optimizer's update;
``--no-backward`` skips it), each round's order shuffled.
"""

import argparse
import dataclasses
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from embedlib import (CollectionLayout, EmbeddingCollection, FeatureSpec, TableSpec,  # noqa: E402
                      options)
from embedlib.collection import fit_id_skews  # noqa: E402
from embedlib import optim  # noqa: E402
from embedlib.plan import cost  # noqa: E402
import timing  # noqa: E402
from timing import interleaved, print_table  # noqa: E402
import collection_lookup  # noqa: E402

BATCH, BAG, WIDTH, DEVICES = 4096, 8, 64, 8
SETS = ((100_000, "uniform"), (20_000, "uniform"), (10_000, "uniform"), (100_000, "zipf"),
        (2_000, "uniform"))
TOLERANCE = 1e-5
PLANS_CHOICE = "plan's choice (auto)"
CONTROL = "plan's choice again (noise control)"
OTHER_CHOICE = "the other choice, table by table"
DEDUP_ALL = "dedup on every sharded table"
DEDUP_NONE = "dedup on none"
#: Each variant's short name in the record's ratios (``<tag>_over_plan_<part>``).
TAGS = {CONTROL: "control", OTHER_CHOICE: "other_choice", DEDUP_ALL: "dedup_all",
        DEDUP_NONE: "dedup_none"}


def make_ids(rows, kind, rng):
  if kind == "uniform":
    return rng.integers(0, rows, (BATCH, BAG)).astype(np.int32)
  return (((rng.zipf(1.05, (BATCH, BAG)) - 1) * 2654435761) % rows).astype(np.int32)


def one_table(args, record):
  mesh = jax.make_mesh((DEVICES,), ("batch",))
  split = jax.NamedSharding(mesh, jax.P("batch"))
  rng = np.random.default_rng(0)
  forwards, steps, choices = {}, {}, []
  print(f"{DEVICES} simulated devices, batch {BATCH}, bags of {BAG}, width {WIDTH}")
  for rows, kind in SETS:
    ids = make_ids(rows, kind, rng)
    need = max(len(np.unique(s)) for s in np.array_split(ids, DEVICES))
    tables = [TableSpec("t", rows, WIDTH, sharding="routed")]
    features = [FeatureSpec("f", "t", max_ids_per_sample=BAG)]
    x = {"f": jax.device_put(ids, split)}
    for capacity in (None, need):
      coll = EmbeddingCollection(
          tables, features, mesh=mesh,
          layout=CollectionLayout(num_unique=capacity, batch_size=BATCH), rngs=nnx.Rngs(0))
      forward, step, state = forward_and_backward(coll)
      name = f"{kind} over {rows:,} rows, " + (f"dedup at {need}" if capacity else "no dedup")
      forwards[name], steps[name] = (forward, (state, x)), (step, (state, x))
    t = coll.plan.tables[0]
    per_id = (t.bytes_moved - t.bytes_moved_dedup) / (BATCH // DEVICES * BAG)
    pays = cost.dedup_pays(t.bytes_moved, t.bytes_moved_dedup, BATCH // DEVICES * BAG)
    choices.append((list(forwards)[-2], list(forwards)[-1], pays,
                    f"{kind}_{timing.size_tag(rows, WIDTH).split('_x_')[0]}"))
    print(f"{kind} over {rows:,} rows: {need} distinct ids a shard; received per device "
          f"{t.bytes_moved:,} B without dedup, {t.bytes_moved_dedup:,} B with: {per_id:.0f} B "
          f"saved an id; dedup_pays: {pays}")
  runs = [("forward", forwards)] + ([("forward + backward", steps)] if args.backward else [])
  for label, cases in runs:
    times = interleaved(cases, args.repeats, between_rounds=record.probe, calls=args.inner)
    print_table(times, next(iter(cases)), f"{label}, {DEVICES} simulated devices, "
                f"{args.repeats} interleaved repeats, ms")
    record.add_times(times, prefix=f"{label}: ")
    for plain, dedup, pays, tag in choices:
      ratio = statistics.median(times[dedup]) / statistics.median(times[plain])
      record.ratio(f"dedup_over_none_{tag}_{label.split(' ')[-1]}", ratio)
      low = min(times[dedup]) / min(times[plain])
      chosen = "dedup" if pays else "no dedup"
      faster = "dedup" if ratio < 1 else "no dedup"
      print(f"{label}: {plain.rsplit(',', 1)[0]}: dedup / no dedup medians {ratio:.2f} "
            f"(min {low:.2f}); cost.dedup_pays chooses {chosen}, measured faster: {faster}")


def pooled_sum(coll, x):
  return sum(jnp.sum(v) for v in coll(x).values())


def forward_and_backward(coll):
  """Jitted ``(forward, forward + backward)`` of ``coll`` and the state they take.

  The backward is the training step's: ``optim.value_and_grad`` of the
  pooled outputs' sum, gradients for the rows the batch looked up (no
  table-sized gradient), before any optimizer applies them.
  """
  graphdef, state = nnx.split(coll)
  forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
  step = jax.jit(lambda s, x: optim.value_and_grad(pooled_sum)(nnx.merge(graphdef, s), x))
  return forward, step, state


def describe(coll):
  """Each sharded table's layout and dedup capacity, then which tables dedup."""
  layouts = ", ".join(f"{t.name} {t.plan.strategy}"
                      + (f" (dedup at {t.num_unique})" if t.name in coll.num_unique else "")
                      for t in coll.plan.tables if t.plan.strategy != options.REPLICATED)
  return f"{layouts}; the rest replicated; dedups {', '.join(coll.num_unique) or 'no table'}"


def savings(name, coll, features, local_batch):
  """Prints, per table ``coll`` dedups, the bytes saved an id and whether ``cost.dedup_pays``."""
  bags = {f.table: f.max_ids_per_sample for f in features}
  saved, paying = [], []
  for t in coll.plan.tables:
    if t.name in coll.num_unique:
      ids = local_batch * bags[t.name]
      saved.append(f"{t.name} {(t.bytes_moved - t.bytes_moved_dedup) / ids:.0f}")
      if cost.dedup_pays(t.bytes_moved, t.bytes_moved_dedup, ids):
        paying.append(t.name)
  if saved:
    print(f"  {name}: bytes dedup saves an id: {', '.join(saved)}; over "
          f"{cost.DEDUP_BYTES_PER_ID}: {', '.join(paying) or 'none'}")


def pinned(tables, coll):
  """``tables`` with the layouts ``coll``'s plan chose, fixed."""
  return [dataclasses.replace(t, sharding=p.plan.strategy)
          for t, p in zip(tables, coll.plan.tables)]


def forced_capacity(table, features, local_batch):
  """The dedup capacity the planner gives ``table`` (its ids' mean distinct count and slack)."""
  ids = local_batch * sum(f.max_ids_per_sample for f in features if f.table == table.name)
  return cost.dedup_capacity([(ids, table.num_embeddings, table.id_skew)])


def collection_variants(tables, features, *, batch_size, mesh):
  """The collections compared, by name: the plan's choice first."""
  build = lambda tables, num_unique: EmbeddingCollection(
      tables, features, mesh=mesh,
      layout=CollectionLayout(num_unique=num_unique, batch_size=batch_size), rngs=nnx.Rngs(0))
  chosen = build(tables, "auto")
  local_batch = batch_size // DEVICES
  forced = {t.name: forced_capacity(t, features, local_batch) for t in tables}
  sharded = [p.name for p in chosen.plan.tables if p.plan.strategy != options.REPLICATED]
  flipped = {n: forced[n] for n in sharded if n not in chosen.num_unique}
  return {
      PLANS_CHOICE: chosen,
      CONTROL: build(tables, "auto"),
      OTHER_CHOICE: build(pinned(tables, chosen), flipped),
      # A copy on every device moves no bytes: dedup there is work no plan would choose.
      DEDUP_ALL: build(tables, {n: forced[n] for n in sharded}),
      DEDUP_NONE: build(tables, None),
  }


def check_equal(outputs):
  """Exits unless every variant's pooled outputs match the plan's choice's."""
  want = outputs[PLANS_CHOICE]
  for name, got in outputs.items():
    if name == PLANS_CHOICE:
      continue
    err = max(float(jnp.max(jnp.abs(got[k] - want[k]))) for k in want)
    print(f"max |{name} - plan's choice| = {err:.2e}")
    if not err <= TOLERANCE:
      raise SystemExit(f"{name}: pooled outputs differ from the plan's choice by {err:.2e}")


def time_and_compare(cases, repeats, label, record, inner=1):
  """One shuffled interleaving of ``cases``; prints it and the ratios to the plan's choice,
  which ``record`` keeps as ``<variant>_over_plan_<forward|backward>``."""
  times = interleaved(cases, repeats, shuffle_seed=0, between_rounds=record.probe, calls=inner)
  record.add_times(times, prefix=f"{label}: ")
  print_table(times, PLANS_CHOICE, f"{label}, {DEVICES} simulated devices, {repeats} "
              "interleaved repeats (order shuffled each round), ms")
  chosen = times[PLANS_CHOICE]
  for name, ts in times.items():
    if name != PLANS_CHOICE:
      print(f"{label}: {name} / plan's choice: median "
            f"{statistics.median(ts) / statistics.median(chosen):.2f}, "
            f"min {min(ts) / min(chosen):.2f}")
      record.ratio(f"{TAGS[name]}_over_plan_{label.split(' ')[-1]}",
                   timing.median_ratio(ts, chosen))


def whole_collection(args, record):
  """The plan's dedup choice on the 26-table collection against dedup everywhere and nowhere."""
  mesh = jax.make_mesh((DEVICES,), ("batch",))
  split = jax.NamedSharding(mesh, jax.P("batch"))
  tables, features = collection_lookup.specs(args.scale)
  ids_np = collection_lookup.make_ids(tables, features, args.batch)
  if not args.uniform:
    # As a user would: each table's skew fitted to a batch of its ids.
    skews = fit_id_skews(tables, features, ids_np, data_shards=DEVICES)
    tables = [dataclasses.replace(t, id_skew=skews[t.name]) for t in tables]
    print("id_skew fitted per table (fit_id_skews): " + ", ".join(
        f"{t.name} {t.id_skew:g}" for t in tables if t.id_skew))
  x = {k: jax.device_put(v, split) for k, v in ids_np.items()}
  needs = collection_lookup.shard_needs(features, ids_np, DEVICES)
  print(f"{DEVICES} simulated devices, 26 tables (--scale {args.scale}, largest "
        f"{tables[0].num_embeddings:,} rows), batch {args.batch}")
  print("most distinct ids on a shard, measured: " + ", ".join(
      f"{t.name} {needs[t.name]}" for t in tables[:10]))
  forwards, steps, outputs = {}, {}, {}
  for name, coll in collection_variants(tables, features, mesh=mesh,
                                        batch_size=args.batch).items():
    print(f"{name}: {describe(coll)}")
    savings(name, coll, features, args.batch // DEVICES)
    forward, step, params = forward_and_backward(coll)
    outputs[name] = forward(params, x)
    forwards[name], steps[name] = (forward, (params, x)), (step, (params, x))
  check_equal(outputs)
  # Apart: a backward's buffers, freed, would weigh on the forward after it.
  time_and_compare(forwards, args.repeats, "forward", record, args.inner)
  if args.backward:
    time_and_compare(steps, args.repeats, "forward + backward", record, args.inner)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--collection", action="store_true",
                      help="the 26-table collection of collection_lookup.py, not one table")
  parser.add_argument("--scale", type=float, default=0.05,
                      help="--collection: rows of each table times this")
  parser.add_argument("--batch", type=int, default=BATCH, help="--collection: samples per step")
  parser.add_argument("--uniform", action="store_true",
                      help="--collection: plan for uniform ids (id_skew 0), not the fitted skews")
  parser.add_argument("--no-backward", dest="backward", action="store_false",
                      help="time the forward only")
  timing.add_inner_argument(parser, since="2026-12-07's eighth session")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  timing.check_inner(parser, args.inner)
  record = timing.Run("dedup_cost", argv)
  (whole_collection if args.collection else one_table)(args, record)
  record.finish(args.json)


if __name__ == "__main__":
  main()
