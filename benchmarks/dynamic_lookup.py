"""A dynamic table's train step against a fixed table's, in one run.

    python3 benchmarks/dynamic_lookup.py           # 1M x 64 f32, 65,536 Zipf ids
    python3 benchmarks/dynamic_lookup.py --quick   # 65,536 x 16, 4,096 ids (--smoke: the same)
    python3 benchmarks/dynamic_lookup.py --zeros-init  # the dynamic rows start at zero: no draws
    python3 benchmarks/dynamic_lookup.py --normal-init # flax's normal draws, not HashedUniform
    python3 benchmarks/dynamic_lookup.py --rows 65536  # tables full after two steps: evictions
    python3 benchmarks/dynamic_lookup.py --parts       # the dynamic step's pieces, timed apart
    python3 benchmarks/dynamic_lookup.py --json run.json   # also the run's record (timing.Run)

One device of jax's default backend, no mesh. Ids are Zipf(1.05) ranks
spread over 64-bit values (raw ids); the fixed table takes them hashed mod
its rows, as ``embedlib.data.criteo`` does today. Each case is the whole
train step, jitted with its state donated: lookup, gradient of
``mean(sum(rows, -1) ** 2)``, row-wise AdaGrad update of the touched rows.

- fixed: ``ShardedEmbed(rows, width)`` with the hashed ids, the same
  batches as the dynamic step's, a new one each step;
- dynamic: ``DynamicEmbed(rows, width)`` (LRU, buckets of 128, admitted on
  first sight) with the raw ids as words: the map's step (sort, bucket
  scan, placement, resets of placed rows and their slots) comes on top;
- dynamic, eval: the dynamic table's lookup alone in ``eval()`` mode, beside
  a fixed lookup alone (the map read without its update);
- TorchRec, when ``.peers/`` is installed (``--no-peers`` leaves them out),
  each in its own worker (``benchmarks/peers/torchrec_mch.py``) fed the same
  batches in the same order: its managed collisions
  (``MCHManagedCollisionModule``, LRU, ``eviction_interval=1``) in front of a
  ``FusedEmbeddingBagCollection`` with fused row-wise AdaGrad, and that fused
  table alone on the hashed ids.

The dynamic table is warmed with a few steps first; after them its map must
equal ``embedlib.dynamic.reference`` run on the same batches (every resident
id and its row), or the script exits 1 before timing anything. Then it takes
new batches until every row is resident (``--no-fill`` leaves this out), so
that the timed steps admit and evict as a running job's do: each new id
evicts a resident, and its row is drawn again. Until the table fills, a step
places rows never placed before, which hold their initial values already,
and draws nothing: a cheaper step that training leaves behind after a few
dozen steps here. The TorchRec workers warm on the same batches. A timed sample
is ``--inner`` steps back to back (default 8), after as many untimed, each
step on a new batch, the TorchRec workers' too (``rounds``). Prints min / median / max ms and
the ratio to the fixed step (the issue's target: at most 1.5 on CPU), the
named ratios beside the machine's state (``record_ratios``; ``--json``'s
record, ``benchmarks/timing.py``), the
map's bytes per row, the last step's statistics and, for the last timed batch, the rows read
by two or more distinct ids on each side (embedlib's must be 0: a
non-resident id reads the default, which is no row). Never asserts a time.
"""

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(2, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from flax.nnx.nn.linear import default_embed_init  # noqa: E402

import embedlib  # noqa: E402
from embedlib import dynamic, optim  # noqa: E402
from embedlib.dynamic import ids as ids_lib  # noqa: E402
from embedlib.dynamic import mapping  # noqa: E402
from embedlib.dynamic import reference  # noqa: E402
from embedlib.dynamic import step as step_lib  # noqa: E402
import timing  # noqa: E402
from timing import print_table, summary, time_calls  # noqa: E402
from worker_protocol import missing_note, peer_env, sample_ms, start_or_note  # noqa: E402

FIXED, DYNAMIC = "fixed: ShardedEmbed step", "dynamic: DynamicEmbed step"
FIXED_EVAL, DYNAMIC_EVAL = "fixed: lookup only", "dynamic: eval lookup only"
TR_FIXED, TR_MCH = "torchrec: fixed FusedEBC step", "torchrec: MCH + FusedEBC step"
HERE = os.path.dirname(os.path.abspath(__file__))
PEER_PYTHON = os.path.join(os.path.dirname(HERE), ".peers", "bin", "python")
MCH_SCRIPT = os.path.join(HERE, "peers", "torchrec_mch.py")
WARM = 4     # steps before the timed ones, on each side: 3 checked + 1 untimed (and --fill's)
FILL_CAP = 200   # the most steps filling the table (the reference steps along, about 2 s each)


def raw_ids(n, seed):
  """Zipf(1.05) ranks as spread 64-bit raw ids (uint64)."""
  ranks = np.random.default_rng(seed).zipf(1.05, n).astype(np.uint64)
  return ranks * np.uint64(0x9E3779B97F4A7C15)


def loss_fn(model, ids):
  return jnp.mean(jnp.sum(model(ids), -1) ** 2)


@nnx.jit(donate_argnums=(0, 1))
def fixed_step(emb, opt, ids):
  loss, grads = optim.value_and_grad(loss_fn)(emb, ids)
  opt.update(emb, grads)
  return loss


@nnx.jit(donate_argnums=(0, 1))
def dynamic_step(emb, opt, words):
  loss, grads = optim.value_and_grad(loss_fn)(emb, words)
  dynamic.reset_slots(opt, emb)
  opt.update(emb, grads)
  return loss


# graph_updates=False: nnx.jit's default would also return the table (a copy per call).
@nnx.jit(graph_updates=False)
def lookup(emb, ids):
  return emb(ids)


def parts(dyn, batches, repeats: int, inner: int, record) -> None:
  """``--parts``: the dynamic step's pieces, each jitted apart on the warmed
  table's state and the next batch (only the placing donates its table): the
  map step (the CPU kernel, and the XLA ops with the sort and the bucket
  scan inside them), lax.sort of the same ids in cheaper forms, for scale,
  and the draws. With the default initializer, also the map step that marks
  and draws its rows itself (the step's one pass on CPU), which changes the
  map it reads: each of its calls takes the next of ``batches``, as the step
  does, on its own copy of the map, the marks and the table."""
  policy = dyn.policy
  state = dyn._state()
  flat = batches[0].value.reshape(-1, 2)
  hi, lo = flat[:, 0], flat[:, 1]
  own = jnp.ones(hi.shape, bool)
  bucket = ids_lib.bucket_of(hi, lo, policy.num_buckets)
  clock = dyn.clock[...]
  key_data = dyn.init_key[...]
  table = dyn.rows.embedding[...]
  _, rows, placed, _ = step_lib.admit_step(state, hi, lo, own, bucket, clock, policy=policy)
  count = int(jnp.sum(placed))
  chunk = mapping.place_chunk(hi.shape[0])
  drawn = -(-count // chunk) * chunk   # the placed rows in whole chunks
  put = jnp.where(placed, rows, policy.capacity)
  at = jnp.arange(drawn, dtype=jnp.int32)
  m = hi.shape[0]
  key_b = jnp.where(own, bucket, policy.num_buckets)
  packed = key_b * m + jnp.arange(m, dtype=jnp.int32)     # fits 31 bits at these sizes
  sort3 = "  sort by (bucket, hi, lo) (step._sort)"
  place = f"draw {drawn:,} rows and place them (mapping._place_rows)"
  pieces = {
      "map step (step.admit_step; C++ kernel on CPU)": (
          functools.partial(step_lib.admit_step, policy=policy),
          (state, hi, lo, own, bucket, clock)),
      "map step, kernel='xla' (XLA ops, as on GPU)": (
          functools.partial(step_lib.admit_step, policy=policy, kernel="xla"),
          (state, hi, lo, own, bucket, clock)),
      sort3: (functools.partial(step_lib._sort, bucket_size=policy.bucket_size),
              (state, hi, lo, own, bucket)),
      "    its lax.sort alone: 3 keys + index": (
          lambda b, h, l: jax.lax.sort((b, h, l, jnp.arange(m, dtype=jnp.int32)), num_keys=3),
          (key_b, hi, lo)),
      "    for scale: 1 key + index (2 operands)": (
          lambda b: jax.lax.sort((b, jnp.arange(m, dtype=jnp.int32)), num_keys=1), (key_b,)),
      "    for scale: one packed int32 operand": (jax.lax.sort, (packed,)),
      "  bucket scan alone (step.lookup, kernel='xla')": (
          functools.partial(step_lib.lookup, bucket_size=policy.bucket_size, kernel="xla"),
          (state, hi, lo, own, bucket)),
      "eval lookup (step.lookup; C++ kernel on CPU)": (
          functools.partial(step_lib.lookup, bucket_size=policy.bucket_size),
          (state, hi, lo, own, bucket)),
      f"draw {drawn:,} initial rows (mapping.init_rows)": (
          lambda k, r: mapping.init_rows(dyn.embedding_init, k, r, table.shape[1], table.dtype),
          (key_data, at)),
      "  with HashedUniform (the default)": (
          lambda k, r: mapping.init_rows(dynamic.HashedUniform(), k, r, table.shape[1],
                                         table.dtype),
          (key_data, at)),
      "  with flax's normal (unrolled threefry)": (
          lambda k, r: mapping.init_rows(default_embed_init, k, r, table.shape[1], table.dtype),
          (key_data, at)),
      "  with flax's normal, jax's stock threefry key": (
          lambda k, r: jax.vmap(lambda x: default_embed_init(
              jax.random.fold_in(jax.random.wrap_key_data(k), x), (1, table.shape[1]),
              table.dtype)[0])(r),
          (key_data, at)),
  }
  cases = {name: functools.partial(jax.jit(fn), *a) for name, (fn, a) in pieces.items()}
  # Placing writes into the table: donated, as in the step, so no table copy is timed.
  placer = jax.jit(lambda k, t, p: mapping._place_rows(dyn.embedding_init, k, t, p, 0),
                   donate_argnums=1)
  held = {"table": jnp.copy(table)}

  def place_case():
    held["table"] = placer(key_data, held["table"], put)
    return held["table"]

  cases[place] = place_case
  if mapping._draws_in_place(dyn.embedding_init, table):
    cases["map step, marks and draws (mapping._step_and_place)"] = one_pass_case(
        dyn, batches)
  for case in cases.values():
    jax.block_until_ready(case())
  times = rounds(cases, repeats, inner, between_rounds=record.probe)
  print(f"\nthe dynamic step's pieces ({count:,} rows placed), ms:")
  for name, ts in times.items():
    print(f"{name:52s} {summary(ts)}")
  record.add_times({name.strip(): ts for name, ts in times.items()})


def one_pass_case(dyn, batches):
  """A call of the one-pass map step per batch of ``batches``, in order, on copies
  of ``dyn``'s map, marks and table, donated from call to call."""
  policy, key_data = dyn.policy, dyn.init_key[...]

  def one_pass(state, placed_at, table, flat, clock):
    return mapping._step_and_place(state, placed_at, table, key_data, clock, flat, 0, 1,
                                   policy=policy, init=dyn.embedding_init)[:3]

  step = jax.jit(one_pass, donate_argnums=(0, 1, 2))
  held = {"map": (jax.tree.map(jnp.copy, dyn._state()), jnp.copy(dyn.placed_at[...]),
                  jnp.copy(dyn.rows.embedding[...])),
          "clock": dyn.clock[...]}
  fresh = iter(batches)

  def case():
    held["map"] = step(*held["map"], next(fresh).value.reshape(-1, 2), held["clock"])
    held["clock"] = held["clock"] + 1
    return held["map"][2]

  return case


def shared_rows(raw: np.ndarray, rows: np.ndarray) -> tuple[int, int]:
  """Rows (``>= 0``) read by two or more distinct raw ids, and the distinct ids on them."""
  keep = rows >= 0
  pairs = np.unique(np.stack([rows[keep].astype(np.int64), raw[keep].view(np.int64)]), axis=1)
  _, per_row = np.unique(pairs[0], return_counts=True)
  return int((per_row >= 2).sum()), int(per_row[per_row >= 2].sum())


def start_peers(args, tmp, batches, rows, width, warmup):
  """The TorchRec workers, started and warmed on the first ``warmup`` batches (those
  before the first timed step, as the JAX side's): ``({name: worker}, notes, stats path)``."""
  if not args.peers:
    return {}, ["TorchRec columns left out (--no-peers)."], None
  if jax.default_backend() != "cpu":
    return {}, [f"TorchRec columns left out: CPU workers, and jax runs on "
                f"{jax.default_backend()!r} here."], None
  missing = missing_note(args.peer_python)
  if missing:
    return {}, [missing], None
  data, stats = os.path.join(tmp, "batches.npz"), os.path.join(tmp, "mch_stats.json")
  np.savez(data, ids=np.stack(batches).view(np.int64))
  env = peer_env(OMP_WAIT_POLICY="PASSIVE")
  workers, notes = {}, []
  for name, variant in ((TR_FIXED, "fixed"), (TR_MCH, "mch")):
    w, info = start_or_note(
        name, [args.peer_python, MCH_SCRIPT, "--data", data, "--rows", str(rows),
               "--width", str(width), "--variant", variant, "--warmup", str(warmup),
               "--threads", str(args.torch_threads), "--stats", stats], env, notes)
    if w is not None:
      print(f"  {name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in info.items()))
      workers[name] = w
  return workers, notes, stats


def rounds(cases: dict, repeats: int, inner: int = 1,
           between_rounds=None) -> dict[str, list[float]]:
  """Round-robin timings (ms per step); a case is a JAX call (timed here) or a
  worker (timed by itself, without the request's round trip). A sample is
  ``inner`` steps back to back, right after as many untimed ones of the same
  case, as a training loop's steps follow each other: timed right after the
  other cases, a step would find its table and state pushed out of the
  caches by theirs (the TorchRec workers' most of all), and the ratios would
  swing with what ran before it (``benchmarks/README.md``, the dynamic
  section); and one step timed alone pays the machine's wake-up, about a
  millisecond added to both steps, which pulls their ratio towards 1
  (``benchmarks/README.md``, "One step timed alone"). ``between_rounds`` is
  called after every round (the run's copy probe)."""
  times = {name: [] for name in cases}
  for _ in range(repeats):
    for name, case in cases.items():
      if callable(case):
        for _ in range(inner):
          jax.block_until_ready(case())
        times[name].append(time_calls(case, (), inner))
      else:
        case.run(inner)
        times[name].append(sample_ms(case, inner))
    if between_rounds is not None:
      between_rounds()
  return times


def record_ratios(record, times) -> None:
  """The named ratios, by medians: ``dynamic_over_fixed`` (the dynamic step's
  time over the fixed step's; target <= 1.5), ``dynamic_eval_over_fixed`` (the
  lookups alone), and with TorchRec ``vs_torchrec_mch`` (its MCH step's time
  over the dynamic step's) and ``torchrec_mch_over_fixed`` (over its own fixed
  step)."""
  record.ratio("dynamic_over_fixed", timing.median_ratio(times[DYNAMIC], times[FIXED]))
  record.ratio("dynamic_eval_over_fixed",
               timing.median_ratio(times[DYNAMIC_EVAL], times[FIXED_EVAL]))
  if TR_MCH in times:
    record.ratio("vs_torchrec_mch", timing.median_ratio(times[TR_MCH], times[DYNAMIC]))
  if TR_MCH in times and TR_FIXED in times:
    record.ratio("torchrec_mch_over_fixed", timing.median_ratio(times[TR_MCH], times[TR_FIXED]))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", "--smoke", action="store_true")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--zeros-init", action="store_true",
                      help="the dynamic table's rows start at zero: its step without the draws")
  parser.add_argument("--normal-init", action="store_true",
                      help="the dynamic table's rows drawn by flax's normal initializer "
                           "(default_embed_init), not the default HashedUniform")
  parser.add_argument("--rows", type=int, default=None,
                      help="rows of every table (default 1,048,576; --quick 65,536): fewer "
                           "rows than the ids seen make the dynamic tables evict")
  parser.add_argument("--parts", action="store_true",
                      help="instead: time the dynamic step's pieces (map step, sort, scan, draws)")
  parser.add_argument("--inner", type=int, default=8,
                      help="steps back to back in one timed sample, after as many untimed "
                           "(default 8; 1: one step a sample, the runs kept before 2026-12-07's "
                           "seventh session)")
  parser.add_argument("--no-fill", dest="fill", action="store_false",
                      help="time the dynamic step from the 4th batch on, its table still filling "
                           "(no evictions, no draws: the runs kept before 2026-12-07's seventh "
                           "session), not once every row is resident")
  parser.add_argument("--no-peers", dest="peers", action="store_false",
                      help="leave out the TorchRec columns")
  parser.add_argument("--torch-threads", type=int, default=2)
  parser.add_argument("--peer-python", default=PEER_PYTHON,
                      help="python of the peer venv (default .peers/bin/python)")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  if args.inner < 1:
    parser.error(f"--inner {args.inner}: a sample takes at least one step; pass 1 or more")
  record = timing.Run("dynamic_lookup", argv, smoke=args.quick)
  rows, width, n = (65_536, 16, 4_096) if args.quick else (1 << 20, 64, 65_536)
  rows = args.rows or rows
  repeats = args.repeats or (5 if args.quick else 7)
  rule = optim.RowWiseAdagrad(learning_rate=0.01)
  fixed = embedlib.ShardedEmbed(rows, width, rngs=nnx.Rngs(0))
  init = ({"embedding_init": nnx.initializers.zeros} if args.zeros_init else
          {"embedding_init": default_embed_init} if args.normal_init else {})
  dyn = embedlib.DynamicEmbed(rows, width, dynamic=embedlib.DynamicSpec(bucket_size=128),
                              rngs=nnx.Rngs(0), **init)
  fixed_opt = optim.SparseAwareOptimizer(fixed, None, rule)
  dyn_opt = optim.SparseAwareOptimizer(dyn, None, rule)
  batches, hashed, words = [], [], []

  def add_batches(count):
    for _ in range(count):
      b = raw_ids(n, len(batches))
      batches.append(b)
      hashed.append(jnp.asarray((b % np.uint64(rows)).astype(np.int32)))
      words.append(dynamic.words(b))

  add_batches(WARM - 1)
  ref = reference.Reference(dyn.policy)

  def warm_step(i):     # warm: a running table's map, checked against the reference's below
    dynamic_step(dyn, dyn_opt, words[i])
    ref.step(reference.as_uint64(batches[i]))

  for i in range(WARM - 1):
    warm_step(i)
  if args.fill:
    # A running job's table is full: each new id evicts a resident, whose
    # row is drawn again. Until it fills, a step places rows never placed
    # before and draws nothing, a cheaper step that training leaves behind.
    filled = 0
    while dyn.stats()["occupancy"] < 1.0 and filled < FILL_CAP:
      add_batches(1)
      warm_step(len(batches) - 1)
      filled += 1
    note = (f"filled: every row resident after {filled} more steps; the timed steps evict"
            if dyn.stats()["occupancy"] >= 1.0 else
            f"filled: NOT full after {FILL_CAP} more steps (occupancy "
            f"{dyn.stats()['occupancy']:.3f}); the timed steps may not evict")
    print(note)
    record.note(note)
  if dyn.resident() != ref.resident():
    print("check: FAILED: the dynamic map differs from the reference's after the warm steps")
    return 1
  print(f"check: ok (the map equals the reference's: {len(ref.resident()):,} resident ids)")
  # The first timed batch: the cases' untimed first call takes it, each
  # round then 2 x --inner more (a step's untimed steps, then its timed ones).
  first = len(batches)
  add_batches(1 + 2 * args.inner * repeats)
  if args.parts:
    parts(dyn, words[first:], repeats, args.inner, record)
    record.finish(args.json)
    return 0
  graphdef, state = nnx.split(dyn)          # a copy: the train step donates dyn's arrays
  frozen = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
  frozen.eval()
  # Each step takes the next batch, so each dynamic step admits new ids (and
  # draws their rows) as a running job's steps do; the fixed step takes the
  # same batches, hashed (one batch over and over would keep its rows in
  # the caches, as no training loop does), and the TorchRec workers take
  # them in the same order.
  fresh, fresh_fixed = iter(range(first, len(batches))), iter(range(first, len(batches)))
  last = {}

  def dyn_case():
    last["i"] = next(fresh)
    return dynamic_step(dyn, dyn_opt, words[last["i"]])

  cases = {
      FIXED: lambda: fixed_step(fixed, fixed_opt, hashed[next(fresh_fixed)]),
      DYNAMIC: dyn_case,
      FIXED_EVAL: lambda: lookup(fixed, hashed[0]),
      DYNAMIC_EVAL: lambda: lookup(frozen, words[0]),
  }
  for case in cases.values():
    jax.block_until_ready(case())
  with tempfile.TemporaryDirectory() as tmp:
    workers, notes, stats_path = start_peers(args, tmp, batches, rows, width, first + 1)
    try:
      times = rounds(dict(cases, **workers), repeats, args.inner,
                     between_rounds=record.probe)
    finally:
      for w in workers.values():
        w.close()
    peer_stats = None
    if TR_MCH in workers and os.path.exists(stats_path):
      with open(stats_path) as f:
        peer_stats = json.load(f)
  train = [k for k in (FIXED, DYNAMIC, TR_FIXED, TR_MCH) if k in times]
  print_table({k: times[k] for k in train}, FIXED,
              f"train step, {rows:,} x {width} f32, {n:,} Zipf ids, {jax.default_backend()}")
  if TR_MCH in times and TR_FIXED in times:
    tr = statistics.median(times[TR_MCH]) / statistics.median(times[TR_FIXED])
    print(f"torchrec MCH step / its fixed step (medians): {tr:.2f}")
  print_table({k: times[k] for k in (FIXED_EVAL, DYNAMIC_EVAL)}, FIXED_EVAL, "lookup only")
  for note in notes:
    print(note)
    record.note(note)
  record.add_times(times)
  record_ratios(record, times)
  print(f"\nmap bytes per row: {dyn.policy.map_bytes_per_row():.0f}; "
        f"distinct ids in a batch: {len(np.unique(batches[0])):,}; last step: {dyn.stats()}")
  # Rows shared by distinct ids: the last timed batch, looked up after its step.
  i = last["i"]
  dyn.eval()
  got = np.asarray(dyn.rows_of(words[i]))
  dyn.train()
  resident = dyn.resident()
  clash = len(resident) - len(set(resident.values()))
  s_rows, s_ids = shared_rows(batches[i], got)
  print(f"rows shared by distinct ids, batch {i}: embedlib {s_rows} ({s_ids} ids; "
        f"{np.mean(got < 0):.4f} of lookups read the default; whole map: {clash} rows "
        f"held by two ids)")
  if peer_stats:
    p = next(s for s in peer_stats if s["batch"] == i)
    print(f"rows shared by distinct ids, batch {i}: torchrec MCH {p['shared_rows']} "
          f"({p['ids_on_shared_rows']} ids; {p['miss_share']:.4f} of lookups read its miss "
          f"row, a trained row); over its {len(peer_stats)} batches after the warm-up: median "
          f"{statistics.median(s['shared_rows'] for s in peer_stats)}")
  if s_rows or clash:
    record.note(f"FAILED: embedlib rows shared by distinct ids {s_rows}, rows held twice {clash}")
  record.finish(args.json)
  return 1 if s_rows or clash else 0


if __name__ == "__main__":
  sys.exit(main())
