"""Past one host: bytes each device receives, and time, per layout on 8 to 64 devices.

    python3 benchmarks/scale.py                   # 8, 16, 32, 64 simulated CPU devices
    python3 benchmarks/scale.py --quick           # 8 and 16 devices, fewer repeats
    python3 benchmarks/scale.py --devices 8 32    # some device counts
    python3 benchmarks/scale.py --nodes           # flat vs node-aware routes, 16 to 64 devices
    python3 benchmarks/scale.py --json run.json   # also the run's record (timing.Run)

Weak scaling: the batch per device is fixed, so each device needs the same
rows at every device count. Two workloads on a ``batch`` mesh (data axes =
table axes, the recommender layout):

- ``sequence``: one 500,000 x 64 f32 table, 256 samples of 32 ids per
  device (8,192 rows needed per device), unpooled;
- ``criteo``: 26 single-hot tables of 12 to 200,000 rows (Criteo's
  cardinalities / 50), 64 wide, 512 samples per device.

Layouts: every table ``vocab`` (today's row split: ids all-gathered, rows
reduce-scattered), ``hidden``, ``routed`` (ids to the row's owner, rows
back), for ``criteo`` also ``stacked`` (``table_batched=True``: the 26
tables in one routed stack, one route per step, small ones placed by the
planner), and ``auto`` (``sharding="auto"``; for ``criteo`` also
``auto, table_batched``). Ids are uniform over each table's rows.

For each device count (one subprocess each, ``XLA_FLAGS`` forcing the
simulated devices) and layout: the bytes one device receives per lookup,
read from the compiled HLO's collectives (``embedlib.plan.hlo``), beside
the planner's estimate; their ratio to the bytes of the rows a device
needs; the bytes it receives per sparse train step (lookup, backward and
the optimizer's input distribution, also from the compiled HLO); and
min / median / max ms of a jitted lookup and of a sparse train
step (``SparseAwareOptimizer``, row-wise AdaGrad), interleaved. Every
layout's lookup is checked equal to ``jnp.take`` on its logical table
before it is timed. A layout whose vocab-sized temporaries would not fit
the host (``--max-temp-gib``: vocab's reduce-scatter buffers, a stack
member read back whole on every simulated device) is compiled for its bytes from abstract
arrays but not run; above
``--time-up-to`` devices every layout is compiled and checked, not timed
(bytes come from the compiled HLO at every device count).

The simulated devices share this machine's cores: times show the
overheads of each layout's collectives, not a speed-up, and grow with the
device count. Targets checked (exit 1 if one fails): routed (for
``criteo``, the stack) moves at most 1.5x the rows a device needs at every
device count; at least 10x fewer bytes than vocab at 64 devices; ``auto``
never moves more than 2x the cheapest layout. Never asserts a time.

``--nodes``: the devices as nodes of 8 (16, 32, 64 devices: 2, 4, 8
nodes; ``--quick``: 16), the ``sequence`` table routed, compiled only
(abstract arrays: nothing drawn or run): the bytes one device receives
from other nodes per lookup and per sparse train step, read from the
compiled HLO (``plan.hlo.inter_node_bytes``), for three routes:

- ``flat``: today's route, every id to its owner over the whole group;
- ``device dedup``: ``devices_per_node=1``, each device's repeats sent
  once (the two-level route with nodes of one device), a baseline;
- ``node``: ``devices_per_node=8``, the two-level route: inside the node,
  then each of the node's distinct ids across once.

Two id workloads of the same shape: ``uniform`` (ids uniform over the
500,000 rows: every capacity the planner's, for uniform ids) and ``zipf``
(ids drawn with probability proportional to ``1 / rank ** ZIPF_S``, ranks
scattered over the rows by a fixed permutation, as hashed recommender ids
are). Zipf ids overflow the uniform capacities, so ``zipf``'s are measured
on two batches of its ids (the largest count, +10%): ``route_capacity`` the
most ids one device sends one owner (``flat`` and ``node``'s first level),
the device dedup's and the node's capacities the most distinct ids one
device, or one node, sends one owner. Every rank receives the same rows
(the lookups are exact, ``tests/embed/test_nodes.py``); a batch past a
capacity crosses with the flat buffers (the same rows). A plan whose
two-level route would not pay keeps the flat one (``EmbeddingPlan.node_pays``:
"plan: flat" in the table). Target: at 64
devices the node route sends at most 1/4 of the flat route's inter-node
bytes per lookup, for ``zipf`` ids; ``uniform``'s ratio is printed beside it.

``--json FILE`` keeps every row in ``benchmarks/timing.py``'s record: its
bytes (``needed``, ``moved``, ``step_moved``, ...) and its lookup's and
step's min / median / max ms, with the named ratio
``moved_over_needed_<workload>_<n>dev_<layout or route>``, beside the
machine's state (a copy probe after each device count's subprocess).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import timing  # noqa: E402

#: Criteo's 26 categorical cardinalities (the Kaggle set), divided by 50.
CRITEO_ROWS = tuple(max(12, n // 50) for n in (
    1460, 583, 10_131_227, 2_202_608, 305, 24, 12_517, 633, 3, 93_145, 5_683, 8_351_593,
    3_194, 27, 14_992, 5_461_306, 10, 5_652, 2_173, 4, 7_046_547, 18, 15, 286_181, 105,
    142_572))
CRITEO_CAP = 200_000
SEQUENCE = dict(rows=500_000, features=64, samples=256, length=32)
CRITEO = dict(features=64, samples=512)
LAYOUTS = {
    "sequence": ("vocab", "hidden", "routed", "auto"),
    "criteo": ("vocab", "hidden", "routed", "stacked", "auto", "auto, table_batched"),
}
OWNER_ROUTED = {"sequence": "routed", "criteo": "stacked"}
#: ``--nodes``: devices per node, and the Zipf exponent of the ``zipf`` ids.
PER_NODE = 8
ZIPF_S = 1.05
ROUTES = {"flat": None, "device dedup": 1, "node": PER_NODE}


def _tables(layout):
  from embedlib import FeatureSpec, TableSpec
  sharding = {"stacked": "routed", "auto, table_batched": "auto"}.get(layout, layout)
  tables = [TableSpec(f"C{i + 1}", min(n, CRITEO_CAP), CRITEO["features"], sharding=sharding)
            for i, n in enumerate(CRITEO_ROWS)]
  return tables, [FeatureSpec(t.name, t.name, max_ids_per_sample=1) for t in tables]


def build(workload, layout, mesh, devices):
  """``(module, inputs, rows needed per device in bytes, planned bytes)``."""
  import jax
  import numpy as np
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  import embedlib

  rng = np.random.default_rng(0)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("batch")))
  if workload == "sequence":
    s = SEQUENCE
    per_device = s["samples"] * s["length"]
    emb = embedlib.ShardedEmbed(
        s["rows"], s["features"], mesh=mesh,
        layout=embedlib.Layout(sharding=layout, ids_per_device=per_device), rngs=nnx.Rngs(0))
    ids = put(rng.integers(0, s["rows"], (devices * s["samples"], s["length"]), dtype=np.int32))
    return emb, ids, per_device * s["features"] * 4, emb.plan.bytes_moved_per_lookup
  tables, features = _tables(layout)
  batch = devices * CRITEO["samples"]
  coll = embedlib.EmbeddingCollection(
      tables, features, mesh=mesh, rngs=nnx.Rngs(0), layout=embedlib.CollectionLayout(
          batch_size=batch, table_batched=layout in ("stacked", "auto, table_batched")))
  ids = {t.name: put(rng.integers(0, t.num_embeddings, batch, dtype=np.int32)) for t in tables}
  needed = len(tables) * CRITEO["samples"] * CRITEO["features"] * 4
  return coll, ids, needed, coll.plan.bytes_moved


def check(workload, module, ids):
  """The lookup equals ``jnp.take`` on the logical tables (exactly); returns the error."""
  import numpy as np
  from flax import nnx
  out = nnx.jit(lambda m, x: m(x))(module, ids)
  if workload == "sequence":
    want = np.asarray(module.logical_table())[np.asarray(ids)]
    return float(np.max(np.abs(np.asarray(out) - want)))
  # One table at a time, each read back before the next is asked for:
  # ``logical_tables()`` would dispatch every table's gather at once (see
  # ``measure``).
  return max(float(np.max(np.abs(np.asarray(out[k]) - np.asarray(module.logical_table(k))[
      np.asarray(ids[k])]))) for k in ids)


def vocab_temp_bytes(workload, devices):
  """Host bytes of the vocab layout's reduce-scatter buffers over all devices."""
  if workload == "sequence":
    rows = SEQUENCE["samples"] * SEQUENCE["length"]
  else:
    rows = CRITEO["samples"] * len(CRITEO_ROWS)
  return devices * devices * rows * 64 * 4


def stack_temp_bytes(module, devices):
  """Host bytes of drawing a collection's stacks and reading one member back.

  A stack is drawn and read back block by block (``embedlib/table.py``, a
  few blocks per device: a few stacks over all devices); a member read
  back (``logical_table``) is whole on every device.
  """
  stacks = getattr(module.plan, "stacks", ())
  stacked = sum(s.plan.padded_shape[0] * s.plan.padded_shape[1] * s.plan.itemsize
                for s in stacks)
  member = max((rows * s.plan.padded_shape[1] * s.plan.itemsize
                for s in stacks for _, rows in s.plan.placement.members), default=0)
  return 4 * stacked + devices * member


def step_bytes_moved(train, module, opt, ids):
  """Bytes one device receives per sparse train step: lookup, backward and update."""
  import jax
  from flax import nnx
  from embedlib.plan import hlo
  graphdef, state = nnx.split((module, opt))

  def pure(state, x):
    m, o = nnx.merge(graphdef, state)
    loss = train(m, o, x)
    return loss, nnx.state((m, o))

  return hlo.bytes_moved(jax.jit(pure).lower(state, ids).compile().as_text())


def measure(devices, args):
  """One device count: a JSON line per layout."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  import embedlib
  from embedlib import optim
  from embedlib.plan import hlo
  sys.path.insert(0, HERE)
  from timing import interleaved

  assert len(jax.devices()) == devices, jax.devices()
  mesh = jax.make_mesh((devices,), ("batch",))
  # Every program is waited for before the next is dispatched. XLA:CPU runs
  # the simulated devices' collectives on a shared thread pool where a
  # participant waiting at a collective holds its thread: with several
  # collective programs queued, criteo on 8 devices stopped at an
  # all-gather with 7 of 8 participants, for good (as
  # ``embedlib.training.train_lib.one_step_in_flight`` says of training).
  for workload in args.workloads:
    for layout in LAYOUTS[workload]:
      if args.layouts and layout not in args.layouts:
        continue
      # Planned and compiled first from abstract arrays (nothing drawn): a
      # layout too big for this host is measured so and not run.
      parts = {}

      def make(layout=layout):
        module, parts["ids"], parts["needed"], parts["planned"] = build(
            workload, layout, mesh, devices)
        return module

      module = nnx.eval_shape(make)
      row = dict(workload=workload, devices=devices, layout=layout, needed=parts["needed"],
                 planned=parts["planned"])
      if workload == "criteo" and layout.startswith("auto"):
        kinds = [t.kind for t in module.plan.tables]
        row["chose"] = ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
      host = vocab_temp_bytes(workload, devices) if layout == "vocab" else 0
      host = max(host, stack_temp_bytes(module, devices))
      if host > args.max_temp_gib * 2**30:
        graphdef, state = nnx.split(module)
        row["moved"] = hlo.bytes_moved(jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x))
                                       .lower(state, parts["ids"]).compile().as_text())
        row["skipped"] = f"{host / 2**30:.1f} GiB of temporaries on this host, not run"
        print(json.dumps(row), flush=True)
        continue
      module, ids, _, _ = build(workload, layout, mesh, devices)
      jax.block_until_ready((nnx.state(module), ids))
      graphdef, state = nnx.split(module)
      lookup = jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x))
      row["moved"] = hlo.bytes_moved(lookup.lower(state, ids).compile().as_text())
      row["error"] = check(workload, module, ids)
      if row["error"] != 0:
        print(json.dumps(row), flush=True)
        raise SystemExit(f"{workload}, {layout}: lookup differs from jnp.take by {row['error']}")
      opt = optim.SparseAwareOptimizer(module, None, optim.RowWiseAdagrad(0.1))
      jax.block_until_ready(nnx.state(opt))

      def train(m, o, x):
        loss_fn = lambda m: sum(jnp.mean(v ** 2) for v in jax.tree.leaves(m(x)))
        loss, grads = optim.value_and_grad(loss_fn)(m)
        o.update(m, grads)
        return loss

      row["step_moved"] = step_bytes_moved(train, module, opt, ids)
      if devices > args.time_up_to:
        row["skipped"] = f"timed up to {args.time_up_to} devices (--time-up-to)"
        print(json.dumps(row), flush=True)
        continue
      step = nnx.jit(train)
      jax.block_until_ready(step(module, opt, ids))  # compiles (the tape's first trace)
      # Each layout timed as soon as it is built and its row printed, so a
      # run cut short keeps the rows it measured; ``time_once`` waits for
      # every call.
      times = interleaved({"lookup": (lookup, (state, ids)), "step": (step, (module, opt, ids))},
                          args.repeats)
      for kind, ts in times.items():
        row[f"{kind}_ms"] = [min(ts), statistics.median(ts), max(ts)]
      print(json.dumps(row), flush=True)


def zipf_ids(devices, seed):
  """``[devices * samples, length]`` Zipf ids over the ``sequence`` table's rows."""
  import numpy as np
  s = SEQUENCE
  rank = np.arange(1, s["rows"] + 1, dtype=np.float64)
  p = rank ** -ZIPF_S
  scatter = np.random.default_rng(1234).permutation(s["rows"])  # hashed ids
  draw = np.random.default_rng(seed).choice(s["rows"], (devices * s["samples"], s["length"]),
                                            p=p / p.sum())
  return scatter[draw].astype(np.int32)


def zipf_capacities(devices):
  """``(route_capacity, device dedup capacity, node capacity)`` of ``zipf`` ids, +10%."""
  import numpy as np
  s = SEQUENCE
  rows_per_rank = -(-s["rows"] // devices)
  found = np.zeros(3, np.int64)
  for seed in (0, 1):
    ids = zipf_ids(devices, seed).reshape(devices, -1)
    owner = ids // rows_per_rank
    for r in range(devices):
      found[0] = max(found[0], np.bincount(owner[r], minlength=devices).max())
    pairs = np.unique(ids.astype(np.int64) + (np.arange(devices)[:, None] << 32), axis=None)
    found[1] = max(found[1], np.bincount((pairs >> 32) * devices + (pairs & 0xFFFFFFFF)
                                         // rows_per_rank).max())
    node = np.arange(devices)[:, None] // PER_NODE
    pairs = np.unique(ids.astype(np.int64) + (node << 32), axis=None)
    found[2] = max(found[2], np.bincount((pairs >> 32) * devices + (pairs & 0xFFFFFFFF)
                                         // rows_per_rank).max())
  return tuple(int(np.ceil(1.1 * f)) for f in found)


def measure_nodes(devices, args):
  """``--nodes``: one device count, a JSON line per workload and route."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  import embedlib
  from embedlib import optim
  from embedlib.plan import hlo

  assert len(jax.devices()) == devices, jax.devices()
  mesh = jax.make_mesh((devices,), ("batch",))
  s = SEQUENCE
  per_device = s["samples"] * s["length"]
  ids = jax.ShapeDtypeStruct((devices * s["samples"], s["length"]), jnp.int32,
                             sharding=NamedSharding(mesh, P("batch")))
  capacities = {"uniform": (None, None, None), "zipf": zipf_capacities(devices)}
  for workload in args.node_workloads:
    route, dedup_cap, node_cap = capacities[workload]
    for name, per in ROUTES.items():
      kw = dict(route_capacity=route)
      if per is not None:
        kw.update(devices_per_node=per, node_capacity=dedup_cap if per == 1 else node_cap)

      def make(kw=kw):
        emb = embedlib.ShardedEmbed(
            s["rows"], s["features"], mesh=mesh, layout=embedlib.Layout(
                sharding="routed", ids_per_device=per_device, **kw), rngs=nnx.Rngs(0))
        return emb, optim.SparseAwareOptimizer(emb, None, optim.RowWiseAdagrad(0.1))

      emb, opt = nnx.eval_shape(make)
      graphdef, state = nnx.split(emb)
      lookup = jax.jit(lambda st, x, g=graphdef: nnx.merge(g, st)(x))
      text = lookup.lower(state, ids).compile().as_text()
      plan = emb.plan
      capacity = plan.capacity_for(per_device)
      row = dict(workload=workload, devices=devices, route=name,
                 needed=per_device * s["features"] * 4, capacity=capacity,
                 node_capacity=plan.node_capacity_for(capacity) if per else None,
                 two_level=plan.node_route,
                 moved=hlo.bytes_moved(text), inter=hlo.inter_node_bytes(text, PER_NODE),
                 planned_inter=plan.node_bytes()[1] if per == PER_NODE else None)

      def train(m, o, x):
        loss, grads = optim.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
        o.update(m, grads)
        return loss

      both, pure_state = nnx.split((emb, opt))

      def pure(st, x):
        m, o = nnx.merge(both, st)
        loss = train(m, o, x)
        return loss, nnx.state((m, o))

      text = jax.jit(pure).lower(pure_state, ids).compile().as_text()
      row.update(step_moved=hlo.bytes_moved(text),
                 step_inter=hlo.inter_node_bytes(text, PER_NODE))
      print(json.dumps(row), flush=True)


def report_nodes(rows):
  """``--nodes``: prints the table and the target; returns the failed targets."""
  print(f"\nbytes one device receives from other nodes (nodes of {PER_NODE} devices), per "
        f"lookup and per sparse train step, from the compiled HLO; the routed sequence table, "
        f"{SEQUENCE['samples'] * SEQUENCE['length']} ids per device")
  head = ("workload", "devices", "route", "capacity", "node cap.", "inter-node (HLO)",
          "planned", "/ flat", "total (HLO)", "step inter-node", "step / flat")
  lines = [head]
  flat = {(r["workload"], r["devices"]): r for r in rows if r["route"] == "flat"}
  for r in rows:
    f = flat.get((r["workload"], r["devices"]))
    route = r["route"] + ("" if r.get("two_level", True) or r["route"] == "flat"
                          else " (plan: flat)")
    lines.append((r["workload"], str(r["devices"]), route, str(r["capacity"]),
                  str(r["node_capacity"] or "-"), _human(r["inter"]),
                  _human(r["planned_inter"]) if r["planned_inter"] is not None else "-",
                  f"{r['inter'] / f['inter']:.3f}" if f else "-", _human(r["moved"]),
                  _human(r["step_inter"]),
                  f"{r['step_inter'] / f['step_inter']:.3f}" if f else "-"))
  widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
  for line in lines:
    print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
  failed = []
  for r in rows:
    f = flat.get((r["workload"], r["devices"]))
    if r["route"] != "node" or f is None or r["devices"] != 64:
      continue
    ratio = r["inter"] / f["inter"]
    if r["workload"] == "zipf":
      ok = ratio <= 0.25 and r.get("two_level", True)
      print(f"target: zipf, 64 devices, node / flat inter-node bytes per lookup = {ratio:.3f} "
            f"(<= 0.25): {'ok' if ok else 'FAILED'}")
      failed += [] if ok else ["zipf-64-nodes"]
    else:
      print(f"(not a target: {r['workload']}, 64 devices, node / flat inter-node bytes per "
            f"lookup = {ratio:.3f}: uniform ids over 500,000 rows seldom repeat inside a node"
            f"{'' if r.get('two_level', True) else ', and the plan keeps the flat route'})")
  return failed


def _human(n):
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024


def report(rows):
  """Prints the table and the targets; returns the failed targets."""
  print("\nbytes one device receives per lookup and per sparse train step (compiled HLO), and "
        "min/median/max ms; the simulated devices share this machine's CPU cores, so times show "
        "overheads, not speed-ups")
  head = ("workload", "devices", "layout", "moved (HLO)", "planned", "x rows needed",
          "vocab / it", "step moved (HLO)", "lookup ms min/med/max", "step ms min/med/max",
          "auto chose")
  lines = [head]
  vocab = {(r["workload"], r["devices"]): r["moved"] for r in rows if r["layout"] == "vocab"}
  for r in rows:
    ms = lambda k: "/".join(f"{t:.0f}" for t in r[k]) if k in r else "not run"
    lines.append((r["workload"], str(r["devices"]), r["layout"], _human(r["moved"]),
                  _human(r["planned"]), f"{r['moved'] / r['needed']:.2f}",
                  f"{vocab[r['workload'], r['devices']] / max(r['moved'], 1):.1f}"
                  if (r["workload"], r["devices"]) in vocab else "-",
                  _human(r["step_moved"]) if "step_moved" in r else "not run",
                  ms("lookup_ms"), ms("step_ms"), r.get("chose", "")))
  widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
  for line in lines:
    print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
  for r in rows:
    if "skipped" in r:
      print(f"{r['workload']}, {r['devices']} devices, {r['layout']}: compiled, "
            f"{'checked, ' if 'error' in r else ''}not timed ({r['skipped']})")
  failed = []
  by = {(r["workload"], r["devices"], r["layout"]): r for r in rows}
  for (workload, devices, layout), r in sorted(by.items()):
    if layout == OWNER_ROUTED[workload]:
      ratio = r["moved"] / r["needed"]
      ok = ratio <= 1.5
      print(f"target: {workload}, {devices} devices, {layout} moves {ratio:.2f}x the rows "
            f"a device needs (<= 1.5): {'ok' if ok else 'FAILED'}")
      failed += [] if ok else [f"{workload}-{devices}-ratio"]
      if devices == 64 and (workload, devices) in vocab:
        fewer = vocab[workload, devices] / r["moved"]
        ok = fewer >= 10
        print(f"target: {workload}, 64 devices, vocab / {layout} = {fewer:.1f}x (>= 10): "
              f"{'ok' if ok else 'FAILED'}")
        failed += [] if ok else [f"{workload}-64-vocab"]
    if layout.startswith("auto"):
      cheapest = min(x["moved"] for (w, d, _), x in by.items() if (w, d) == (workload, devices))
      ok = r["moved"] <= 2 * max(cheapest, 1)
      print(f"target: {workload}, {devices} devices, {layout} moves {r['moved'] / max(cheapest, 1):.2f}x "
            f"the cheapest layout (<= 2): {'ok' if ok else 'FAILED'}")
      failed += [] if ok else [f"{workload}-{devices}-{layout}"]
      steps = [x["step_moved"] for (w, d, _), x in by.items()
               if (w, d) == (workload, devices) and "step_moved" in x]
      if "step_moved" in r:  # not a target: a lone table's auto weighs the lookup only
        print(f"(step: {workload}, {devices} devices, {layout}'s sparse step moves "
              f"{r['step_moved'] / max(min(steps), 1):.2f}x the cheapest layout's step)")
  return failed


#: A row's figures kept in the record, and their units.
ROW_FIGURES = {"needed": "bytes", "planned": "bytes", "moved": "bytes", "step_moved": "bytes",
               "inter": "bytes", "planned_inter": "bytes", "step_inter": "bytes",
               "lookup_ms": "ms", "step_ms": "ms"}


def record_rows(record, rows) -> None:
  """Each row's figures as cases, and its bytes moved over the bytes needed as a ratio."""
  for r in rows:
    tag = f"{r['workload']}_{r['devices']}dev_{r.get('layout') or r.get('route')}"
    tag = tag.replace(",", "").replace(" ", "_")
    for key, unit in ROW_FIGURES.items():
      if r.get(key) is not None:
        record.add_case(f"{tag}: {key}", r[key], unit)
    if r.get("moved") is not None and r.get("needed"):
      record.ratio(f"moved_over_needed_{tag}", r["moved"] / r["needed"])
    if r.get("skipped"):
      record.note(f"{tag}: {r['skipped']}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, nargs="+", default=None)
  parser.add_argument("--workloads", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--layouts", nargs="+", default=None,
                      help="only these layouts (default: every one of each workload)")
  parser.add_argument("--quick", action="store_true", help="8 and 16 devices, 2 repeats")
  parser.add_argument("--max-temp-gib", type=float, default=3.0,
                      help="don't run a layout needing more host memory than this")
  parser.add_argument("--time-up-to", type=int, default=64,
                      help="above this many devices, compile and check each layout, don't time it")
  parser.add_argument("--nodes", action="store_true",
                      help="flat vs node-aware routes' inter-node bytes (compiled only)")
  parser.add_argument("--node-workloads", nargs="+", default=["uniform", "zipf"],
                      choices=["uniform", "zipf"])
  parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  args.repeats = args.repeats or (2 if args.quick else 5)
  if args.worker is not None:
    (measure_nodes if args.nodes else measure)(args.worker, args)
    return 0
  if args.nodes:
    devices = args.devices or ([16] if args.quick else [16, 32, 64])
  else:
    devices = args.devices or ([8, 16] if args.quick else [8, 16, 32, 64])
  record = timing.Run("scale", argv, smoke=args.quick)
  import jax  # only for the versions
  print(f"jax {jax.__version__}; {os.cpu_count()} CPU cores shared by every simulated device")
  rows = []
  for n in devices:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               # One device's thread may wait minutes for the others on shared cores:
               # XLA's default 40 s rendezvous timeout would abort the run.
               XLA_FLAGS=f"--xla_force_host_platform_device_count={n} "
               "--xla_cpu_collective_call_terminate_timeout_seconds=1800")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(n), "--repeats",
           str(args.repeats), "--max-temp-gib", str(args.max_temp_gib), "--time-up-to",
           str(args.time_up_to), "--workloads", *args.workloads,
           *(["--layouts", *args.layouts] if args.layouts else []),
           *(["--nodes", "--node-workloads", *args.node_workloads] if args.nodes else [])]
    # Each row printed as the worker measures it: a run cut short keeps them.
    # Its log to a file: a full stderr pipe would stall it.
    with tempfile.TemporaryFile("w+") as log, subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True) as worker:
      got = []
      for line in worker.stdout:
        if line.startswith("{"):
          got.append(json.loads(line))
          print(line.rstrip(), flush=True)
      worker.wait()
      log.seek(0)
      stderr = log.read()
    rows += got
    record.probe()
    print(f"{n} devices: {len(got)} layouts measured", flush=True)
    if worker.returncode != 0:
      print(stderr[-3000:])
      return 1
  failed = report_nodes(rows) if args.nodes else report(rows)
  print("all targets met" if not failed else f"targets failed: {failed}")
  record_rows(record, rows)
  if failed:
    record.note(f"targets failed: {failed}")
  record.finish(args.json)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
