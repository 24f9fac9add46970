"""ShardedEmbed lookup throughput against plain jnp.take, in one run.

    python benchmarks/lookup.py            # 1M x 64 f32 table, 65,536 ids
    python benchmarks/lookup.py --quick    # small sizes, a smoke run
    python benchmarks/lookup.py --json run.json   # also the run's record (timing.Run)
    python benchmarks/lookup.py --inner 1  # one call a sample (the runs before 2026-12-07's eighth session)

A sample is ``--inner`` calls back to back (default 8), in ms a call: one
call timed alone pays the machine's wake-up (``benchmarks/README.md``, "One
step timed alone").

Part 1, one device: ShardedEmbed (replicated, no mesh) vs raw ``jnp.take``
on the same table and ids (target: median ratio <= 1.10), with its default
kernel (on CPU the C++ gather of ``kernels/gather_cpu.py``) and, beside it,
``kernel="xla"`` (the jnp reference).
Part 2, 8 simulated CPU devices: each strategy over one axis vs a
replicated table with batch-split ids (what plain data parallelism does).
Part 3, the same 8 devices as LLM training lays them out, fsdp=2 x tensor=4
with the ids split over 'fsdp': the grid (rows over 'tensor', columns over
'fsdp', what ``P('tensor', 'fsdp')`` asks for) beside vocab and hidden over
'tensor', against the replicated table. Simulated devices share this
machine's cores, so parts 2 and 3 measure overhead, not scaling.

Before timing, every case's output is compared with ``reference`` (``jnp.take``
on the case's logical table, on the host): it must be equal, exactly, since
every kernel and strategy copies rows. A case that differs is named and the
script exits 1 before timing that part.

Named ratios (medians; printed beside the machine's state and kept by
``--json FILE``, ``benchmarks/timing.py``): ``sharded_over_take`` (part 1,
the default kernel's time over ``jnp.take``'s, target <= 1.10), and per
layout of parts 2 and 3 its time over the replicated table's
(``<layout>_over_replicated_8dev``, ``<layout>_over_replicated_fsdp_tensor``).
"""

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import embedlib  # noqa: E402
from embedlib import axes  # noqa: E402
from embedlib import options  # noqa: E402
import timing  # noqa: E402
from timing import interleaved, print_table  # noqa: E402


def zipf_ids(n, vocab, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray((rng.zipf(1.05, n) - 1) % vocab, jnp.int32)


def reference(table, ids):
  """The answer every case must give: ``jnp.take`` of the logical table."""
  return jnp.take(table, ids, axis=0)


def agree(cases, wants, reference_fn=reference) -> bool:
  """Runs each case once and compares it with ``reference_fn`` on its table.

  Args:
    cases: name -> ``(fn, args)``, as timed.
    wants: name -> ``(table, ids)``, the logical table and ids the case looks up.
    reference_fn: ``(table, ids) -> rows``, computed on host copies.

  Returns:
    Whether every case equals its reference exactly; each one that does not
    is printed.
  """
  ok = True
  for name, (fn, args) in cases.items():
    table, ids = (np.asarray(x) for x in wants[name])
    got, want = np.asarray(fn(*args)), np.asarray(reference_fn(table, ids))
    if got.shape != want.shape or not np.array_equal(got, want):
      print(f"lookup: {name} differs from the reference (shape {got.shape} vs {want.shape})")
      ok = False
  return ok


def one_device(vocab, width, n, repeats, record, reference_fn=reference, inner=1):
  emb = embedlib.ShardedEmbed(vocab, width, rngs=nnx.Rngs(0))
  table = emb.embedding[...]
  ids = zipf_ids(n, vocab)
  take = jax.jit(lambda t, i: jnp.take(t, i, axis=0))
  graphdef, state = nnx.split(emb)
  sharded = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))
  cases = {
      "jnp.take": (take, (table, ids)),
      f"ShardedEmbed (one device, kernel {embedlib.kernels.resolve_kernel('auto')!r})":
          (sharded, (state, ids)),
  }
  wants = dict.fromkeys(cases, (emb.logical_table(), ids))
  if embedlib.kernels.resolve_kernel("auto") != "xla":
    # The jnp reference beside the default kernel (on CPU: the C++ gather).
    xla = embedlib.ShardedEmbed(vocab, width, layout=embedlib.Layout(kernel="xla"),
                                rngs=nnx.Rngs(0))
    xla_graphdef, xla_state = nnx.split(xla)
    name = "ShardedEmbed (one device, kernel 'xla')"
    cases[name] = (jax.jit(lambda s, i: nnx.merge(xla_graphdef, s)(i)), (xla_state, ids))
    wants[name] = (xla.logical_table(), ids)
  if not agree(cases, wants, reference_fn):
    return False
  times = interleaved(cases, repeats, between_rounds=record.probe, calls=inner)
  print_table(times, "jnp.take", f"one device: {vocab} x {width} f32, {n} Zipf ids, ms")
  record.add_times(times, prefix="one device: ")
  record.ratio("sharded_over_take", timing.median_ratio(times[list(cases)[1]], times["jnp.take"]))
  return True


def record_layouts(record, times, part):
  """Each layout's median over the first (replicated) one's: ``<layout>_over_replicated_<part>``."""
  base = next(iter(times))
  record.add_times(times, prefix=f"{part}: ")
  for name, ts in list(times.items())[1:]:
    record.ratio(f"{name.split(' ')[0]}_over_replicated_{part}",
                 timing.median_ratio(ts, times[base]))


def mesh_cases(mesh, vocab, width, n, layouts, reference_fn=reference):
  """Each layout's lookup of the same Zipf ids, split over the mesh's first axis.

  Args:
    layouts: strategy -> its other ``embedlib.Layout`` settings; the first
      is the baseline.

  Returns:
    The timed cases, or None when one differs from ``reference_fn``.
  """
  ids = jax.device_put(zipf_ids(n, vocab), NamedSharding(mesh, P(mesh.axis_names[0])))
  cases, wants = {}, {}
  for strategy, kwargs in layouts.items():
    emb = embedlib.ShardedEmbed(vocab, width, mesh=mesh,
                                layout=embedlib.Layout(sharding=strategy, **kwargs),
                                rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(emb)
    fn = jax.jit(lambda s, i, g=graphdef: nnx.merge(g, s)(i))
    name = f"{strategy} ({emb.plan.bytes_per_device / 2**20:.0f} MiB/device)"
    cases[name] = (fn, (state, ids))
    wants[name] = (emb.logical_table(), ids)
  return cases if agree(cases, wants, reference_fn) else None


def eight_devices(vocab, width, n, repeats, record, reference_fn=reference, inner=1):
  mesh = jax.make_mesh((8,), (axes.BATCH,))
  # A grid needs a second axis for its columns: part 3.
  layouts = {s: {} for s in options.STRATEGIES if s != options.GRID}
  cases = mesh_cases(mesh, vocab, width, n, layouts, reference_fn)
  if cases is None:
    return False
  times = interleaved(cases, repeats, between_rounds=record.probe, calls=inner)
  print_table(times, next(iter(cases)), f"8 simulated devices: {vocab} x {width} f32, {n} Zipf "
              "ids split over 'batch', ms")
  record_layouts(record, times, "8dev")
  return True


def fsdp_by_tensor(vocab, width, n, repeats, record, reference_fn=reference, inner=1):
  mesh = jax.make_mesh((2, 4), (axes.FSDP, axes.TENSOR))
  rows = dict(table_axes=(axes.TENSOR,))
  layouts = {options.REPLICATED: {}, options.VOCAB: rows, options.HIDDEN: rows,
             options.GRID: dict(rows, column_axes=(axes.FSDP,))}
  cases = mesh_cases(mesh, vocab, width, n, layouts, reference_fn)
  if cases is None:
    return False
  times = interleaved(cases, repeats, between_rounds=record.probe, calls=inner)
  print_table(times, next(iter(cases)), f"fsdp=2 x tensor=4 simulated devices: {vocab} x "
              f"{width} f32, {n} Zipf ids split over 'fsdp', tables over 'tensor' (grid: "
              "columns over 'fsdp'), ms")
  record_layouts(record, times, "fsdp_tensor")
  return True


def main(argv=None, reference_fn=reference) -> int:
  """Runs the benchmark; 1 if a case differs from ``reference_fn`` (then nothing is timed)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
  parser.add_argument("--repeats", type=int, default=None)
  timing.add_inner_argument(parser, since="2026-12-07's eighth session")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  timing.check_inner(parser, args.inner)
  record = timing.Run("lookup", argv, smoke=args.quick)
  vocab, width, n = (10_000, 64, 4096) if args.quick else (1_000_000, 64, 65_536)
  repeats = args.repeats or (3 if args.quick else 30)
  print(f"jax {jax.__version__}, {jax.default_backend()}, {len(jax.devices())} devices")
  for part in (one_device, eight_devices, fsdp_by_tensor):
    if not part(vocab, width, n, repeats, record, reference_fn, inner=args.inner):
      print("lookup: a case differs from the reference; not timing it.")
      return 1
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
