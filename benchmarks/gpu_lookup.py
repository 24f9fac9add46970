"""GPU benchmark of embedlib's local lookup kernels against the bandwidth limit and baselines.

Run on a machine with one NVIDIA GPU::

  python benchmarks/gpu_lookup.py            # the table
  python benchmarks/gpu_lookup.py --check    # first compare every kernel to its reference

For 1M x 128 and 10M x 64 tables, float32 and bfloat16, uniform and Zipf(1.05)
ids, it times a row gather of 65,536 ids and pooled ``sum`` bags of 16 and 64
ids (65,536 ids in all: 4,096 and 1,024 bags), and the backward's per-row
reduction of 65,536 gradient rows. Side by side, in the same run: embedlib's
Mosaic GPU kernels (``mosaic``), its Triton kernels (``triton``, while this
jax has the backend), XLA (``jnp.take``; ``take`` + ``segment_sum`` for
bags, the ``vs xla`` base; a scatter-add of rows for the backward) and
``xla-slots`` (embedlib's own ``kernel="xla"`` bag), the sorted scan of the
GPU sparse update for the backward (``sorted-scan``),
``torch.nn.functional.embedding`` / ``embedding_bag`` on CUDA when torch
imports, and a device-to-device copy of 1 GiB (the bandwidth limit). Each
timing runs the operation ``--inner`` times in one jitted loop (so that a
short one is not swamped by dispatch) and reports min / median / max per
call over ``--repeats`` runs. It never asserts a time. On a machine without
a GPU it says so, measures nothing and exits 0; ``--smoke`` runs the whole
script at tiny sizes on any backend (the kernels interpreted on a CPU).
``--json FILE`` keeps every timed row (µs per call) in
``benchmarks/timing.py``'s record, the device copy's GB/s, and each row's
speed-up over XLA as ``<backend>_vs_xla_<op>_<table>_<ids>``
(``xla_slots_vs_xla_bag64_1Mx128_f32_zipf``), beside the host's state.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import timing  # noqa: E402

TABLES = ((1_000_000, 128), (10_000_000, 64))
DTYPES = ("float32", "bfloat16")
DISTRIBUTIONS = ("uniform", "zipf")
NUM_IDS = 65_536
BAG_SIZES = (16, 64)
COPY_BYTES = 1 << 30


def make_ids(num_embeddings: int, n: int, distribution: str, seed: int = 0) -> np.ndarray:
  """Uniform ids, or Zipf(1.05) ranks scattered over the table by a multiplicative hash."""
  rng = np.random.default_rng(seed)
  if distribution == "uniform":
    return rng.integers(0, num_embeddings, n, dtype=np.int64).astype(np.int32)
  ranks = (rng.zipf(1.05, n) - 1) % num_embeddings
  # Hot rows land far apart, as hashed feature ids do, not in one cache line.
  return ((ranks * 2_654_435_761) % num_embeddings).astype(np.int32)


def timed_loop(op, inner: int, rows: int | None = None):
  """Jitted ``inner`` sequential calls of ``op(table, ids)``; each output fully materialised.

  ``rows``: the id range (default the table's rows).
  """

  def run(table, ids):
    def body(i, acc):
      # Shifting valid ids keeps each call distinct (no hoisting) at a
      # negligible cost; the barrier stops XLA from fusing the lookup into
      # the one element read back, which would skip writing its output.
      shifted = jnp.where(ids >= 0, (ids + i) % (rows or table.shape[0]), ids)
      out = jax.lax.optimization_barrier(op(table, shifted))
      return acc + out.reshape(-1)[0].astype(jnp.float32)

    return jax.lax.fori_loop(0, inner, body, jnp.float32(0))

  return jax.jit(run)


def measure(fn, args, inner: int, repeats: int) -> np.ndarray:
  """Seconds per call: one warm-up, then ``repeats`` timed runs of ``inner`` calls."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) / inner)
  return np.array(times)


def copy_bandwidth(copy_bytes: int, inner: int, repeats: int) -> float:
  """Bytes moved per second (read + write) by a device-to-device copy, median."""
  x = jnp.zeros((copy_bytes // 4,), jnp.float32)
  inner = max(inner // 10, 2)
  fn = timed_loop(lambda t, _: t + 1.0, inner)
  secs = measure(fn, (x, jnp.zeros((1,), jnp.int32)), inner, repeats)
  return 2 * copy_bytes / float(np.median(secs))


def torch_ops():
  """``(embedding, embedding_bag)`` timers on CUDA, or None when torch or CUDA is missing."""
  try:
    import torch
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None

  def timer(kind, table_np_shape, dtype, ids_np, bag, inner, repeats):
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    weight = torch.randn(table_np_shape, device="cuda", dtype=tdtype)
    ids = torch.from_numpy(ids_np.astype(np.int64)).cuda()
    if kind == "bag":
      ids = ids.view(-1, bag)
    call = (
        (lambda: torch.nn.functional.embedding(ids, weight))
        if kind == "gather"
        else (lambda: torch.nn.functional.embedding_bag(ids, weight, mode="sum"))
    )
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
      start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      for _ in range(inner):
        call()
      stop.record()
      torch.cuda.synchronize()
      times.append(start.elapsed_time(stop) / 1e3 / inner)
    del weight
    return np.array(times)

  return timer


def backends() -> list[str]:
  """The Pallas backends to time: Mosaic GPU, and Triton while this jax has it."""
  from jax.experimental.pallas import mosaic_gpu  # noqa: F401  (every supported jax)

  try:
    from jax.experimental.pallas import triton  # noqa: F401
  except ImportError:
    return ["mosaic"]
  return ["mosaic", "triton"]


def check(rows: int = 10_000, batch: int = 257, verbose: bool = True, references=None) -> bool:
  """Compares every kernel of every backend (and gradient) with its reference on the GPU.

  The reference runs on the float32 copy of the table, so bf16 kernels are
  judged against the exact answer (to bf16 rounding, 2e-2 relative), not
  against XLA's bf16 accumulation.

  Args:
    rows, batch: the tables' rows and the bags in a batch.
    verbose: print every check, not only the mismatches.
    references: optional ``{"gather": fn, "bag": fn}`` in place of
      ``kernels.gather_reference`` / ``kernels.bag_reference`` (same
      signatures), e.g. a wrong one, to see the check fail.

  Returns:
    Whether every kernel and gradient is within tolerance.
  """
  from embedlib import kernels

  refs = {"gather": kernels.gather_reference, "bag": kernels.bag_reference, **(references or {})}
  ok = True
  key = jax.random.PRNGKey(0)
  shapes = [((rows, 100), "float32"), ((rows, 128), "bfloat16"), ((7, 1), "float32")]
  for (vocab, features), dtype in shapes:
    table = jax.random.normal(key, (vocab, features)).astype(dtype)
    exact = table.astype(jnp.float32)
    ids = jax.random.randint(key, (batch, 9), -3, vocab + 3)
    weights = jax.random.uniform(key, ids.shape, minval=0.1, maxval=2.0)
    tol = 1e-5 if dtype == "float32" else 2e-2
    # A fixed cotangent (bags use its first slot): gradients linear in each use.
    cot = jax.random.normal(jax.random.PRNGKey(1), ids.shape + (features,))
    def g(fn, t):
      def loss(t):
        out = fn(t).astype(jnp.float32)
        return jnp.sum(out * (cot[:, 0, :] if out.ndim == 2 else cot))

      return jax.grad(loss)(t)

    cases = {}
    for backend in backends():
      cases[f"{backend} gather"] = (kernels.gather(table, ids, kernel=backend),
                                    refs["gather"](exact, ids))
      cases[f"{backend} gather grad"] = (
          g(lambda t: kernels.gather(t, ids, kernel=backend), table),
          g(lambda t: refs["gather"](t, ids), exact),
      )
      for combiner in ("sum", "mean", "sqrtn"):
        for w in (None, weights):
          name = f"{backend} bag {combiner}{'' if w is None else ' weighted'}"
          pallas = lambda t: kernels.bag(t, ids, w, combiner=combiner, kernel=backend)
          ref = lambda t: refs["bag"](t, ids, w, combiner=combiner)
          cases[name] = (pallas(table), ref(exact))
          cases[name + " grad"] = (g(pallas, table), g(ref, exact))
    for name, (got, want) in cases.items():
      got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
      # Normalised by the largest entry: sums with cancellation have entries
      # near 0 whose bf16 error is relative to the terms, not to the sum.
      err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
      good = err <= tol
      ok &= good
      if verbose or not good:
        print(f"check {name:<31} {vocab}x{features} {dtype:<8} max err / max {err:.2e} "
              f"{'ok' if good else 'MISMATCH'}")
  return ok


def xla_bag(table, ids):
  batch, bag = ids.shape
  rows = jnp.take(table, ids.reshape(-1), axis=0)
  segments = jnp.arange(batch * bag, dtype=jnp.int32) // bag
  return jax.ops.segment_sum(rows, segments, num_segments=batch, indices_are_sorted=True)


def keep_row(record, label, name, secs, base) -> None:
  """A timed row in ``record``: its µs per call, and its speed-up over XLA's median."""
  record.add_case(f"{label} {name}", [float(x) * 1e6 for x in secs], "us")
  if name != "xla" and base:
    what, rest = label.split(" ", 1)
    tag = re.sub(r"[^A-Za-z0-9]+", "_", f"{name}_vs_xla_{what}_{rest}").strip("_")
    record.ratio(tag, base / float(np.median(secs)))


def fmt_row(label, secs, rows_bytes, moved_bytes, copy_bw, base):
  lo, med, hi = (float(np.min(secs)), float(np.median(secs)), float(np.max(secs)))
  ratio = f"{base / med:5.2f}x" if base else "   - "
  return (f"{label:<44} {lo * 1e6:8.1f} {med * 1e6:8.1f} {hi * 1e6:8.1f} "
          f"{rows_bytes / med / 1e9:8.1f} {100 * moved_bytes / med / copy_bw:6.1f}% {ratio}")


def main(argv=None, references=None) -> int:
  """Runs the benchmark; 1 if ``--check`` fails (``references`` as in `check`)."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--check", action="store_true", help="compare kernels to references first")
  parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement")
  parser.add_argument("--inner", type=int, default=50, help="lookups per timed run")
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds after which no new case starts (the GPU session's limit)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes on any backend (Pallas interpreted on CPU): tests the "
                      "script itself; its numbers mean nothing")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)

  backend = jax.default_backend()
  tables, num_ids, copy_bytes, distributions = TABLES, NUM_IDS, COPY_BYTES, DISTRIBUTIONS
  if args.smoke:
    tables, num_ids, copy_bytes, distributions = ((1000, 100),), 256, 1 << 20, ("zipf",)
    args.inner, args.repeats = 2, 2
    print("gpu_lookup --smoke: tiny sizes to exercise the script; the numbers are not measurements.")
  elif backend != "gpu":
    print(f"gpu_lookup: the default jax backend is {backend!r}, not a GPU; this benchmark "
          "measures GPU kernels only, so it measures nothing here.")
    return 0
  from embedlib import kernels

  record = timing.Run("gpu_lookup", argv, smoke=args.smoke)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
  size = dict(rows=100, batch=33) if args.smoke else {}
  if args.check and not check(**size, references=references):
    print("gpu_lookup --check: kernels disagree with their references; not benchmarking.")
    return 1

  copy_bw = copy_bandwidth(copy_bytes, args.inner, args.repeats)
  print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write), the bandwidth limit")
  record.add_case("device-to-device copy", copy_bw / 1e9, "GB/s")
  torch_timer = torch_ops()
  print("torch: " + ("CUDA embedding / embedding_bag measured" if torch_timer else "not importable or no CUDA; skipped"))
  print(f"\n{'case':<44} {'min us':>8} {'med us':>8} {'max us':>8} {'rowGB/s':>8} {'%copy':>7} {'vs xla':>6}")

  # interpret=None: compiled on the GPU, interpreted only in --smoke on a CPU.
  pallas = {b: (lambda t, i, b=b: kernels.gather(t, i, kernel=b),
                lambda t, i, b=b: kernels.bag(t, i, combiner="sum", kernel=b)) for b in backends()}
  xla_gather = lambda t, i: jnp.take(t, i, axis=0)
  started, skipped = time.monotonic(), 0
  measured = []   # (what, case, backend, fraction of copy bandwidth, speed-up over XLA)
  over = lambda: args.budget is not None and time.monotonic() - started > args.budget
  for rows, features in tables:
    for dtype in DTYPES:
      if over():
        skipped += 1
        continue
      table = jax.random.normal(jax.random.PRNGKey(1), (rows, features), jnp.float32).astype(dtype)
      itemsize = jnp.dtype(dtype).itemsize
      rows_bytes = num_ids * features * itemsize
      for dist in distributions:
        ids_np = make_ids(rows, num_ids, dist)
        for bag in (None,) + BAG_SIZES:
          ids = jnp.asarray(ids_np if bag is None else ids_np.reshape(-1, bag))
          out_bytes = rows_bytes if bag is None else rows_bytes // bag
          moved = rows_bytes + out_bytes
          what = "gather" if bag is None else f"bag{bag}"
          label = f"{what} {shape_label(rows, features, dtype)} {dist}"
          ops = [("xla", xla_gather if bag is None else xla_bag)]
          ops += [(b, fns[0] if bag is None else fns[1]) for b, fns in pallas.items()]
          if bag is not None:  # the library's own XLA bag (kernels/bag_xla.py)
            ops.append(("xla-slots", lambda t, i: kernels.bag(t, i, kernel="xla")))
          results = {}
          for name, op in ops:
            results[name] = measure(timed_loop(op, args.inner), (table, ids), args.inner, args.repeats)
          if torch_timer:
            results["torch"] = torch_timer("gather" if bag is None else "bag", (rows, features),
                                           dtype, ids_np, bag, args.inner, args.repeats)
          base = float(np.median(results["xla"]))
          for name, secs in results.items():
            print(fmt_row(f"{label} {name}", secs, rows_bytes, moved, copy_bw, base))
            keep_row(record, label, name, secs, base)
            med = float(np.median(secs))
            measured.append((what, label, name, moved / med / copy_bw, base / med))
        backward(table, make_ids(rows, num_ids, dist), f"{shape_label(rows, features, dtype)} {dist}",
                 copy_bw, args, record)
      del table
      record.probe()
  if skipped:
    print(f"\n--budget {args.budget:g} s reached: {skipped} table(s) not measured.")
    record.note(f"--budget {args.budget:g} s reached: {skipped} table(s) not measured")
  print_targets(measured)
  print("\nrowGB/s: bytes of table rows read per second (backward: gradient rows read). %copy: "
        "(rows read + output written) per second over the copy's (read + write). vs xla: XLA "
        "median time / this median time.")
  record.finish(args.json)
  return 0


#: Issue 18's targets on an H200: gather, share of the copy bandwidth; bags, speed-up over XLA.
GATHER_TARGET, BAG_TARGET = 0.80, 2.0


def print_targets(measured) -> None:
  """Each Pallas backend's worst case against the targets, and the cases XLA wins.

  ``measured``: ``(what, case, backend, fraction of copy, speed-up over XLA)``
  per timed row. Where a backend is slower than XLA, ``kernel="auto"``
  should take XLA for that shape: the lines say which.
  """
  print(f"\ntargets (H200): gather >= {GATHER_TARGET:.0%} of the copy bandwidth; pooled bag >= "
        f"{BAG_TARGET:g}x XLA's take + segment_sum")
  for backend in backends():
    rows = [m for m in measured if m[2] == backend]
    gathers = [m for m in rows if m[0] == "gather"]
    bags = [m for m in rows if m[0] != "gather"]
    if gathers:
      worst = min(gathers, key=lambda m: m[3])
      met = "met" if worst[3] >= GATHER_TARGET else "NOT met"
      print(f"target gather {backend}: worst {100 * worst[3]:.1f}% of copy ({worst[1]}), best "
            f"{100 * max(m[3] for m in gathers):.1f}%: {met}")
    if bags:
      worst = min(bags, key=lambda m: m[4])
      met = "met" if worst[4] >= BAG_TARGET else "NOT met"
      print(f"target bag {backend}: worst {worst[4]:.2f}x XLA ({worst[1]}), best "
            f"{max(m[4] for m in bags):.2f}x: {met}")
    for what, case, _, _, speedup in rows:
      if speedup < 1:
        print(f"slower than XLA: {case} {backend} ({speedup:.2f}x): auto should take XLA here")


def shape_label(rows, features, dtype) -> str:
  size = f"{rows / 1e6:g}M" if rows >= 10**6 else str(rows)
  return f"{size}x{features} {'f32' if dtype == 'float32' else 'bf16'}"


def backward(table, ids_np, label, copy_bw, args, record):
  """Times the backward's reduction: one summed row per distinct id of ``ids_np``.

  ``mosaic``: the Mosaic GPU kernel (`backward_mosaic.row_sums`); ``xla``:
  a scatter-add of every gradient row into its distinct row's slot (what
  XLA's own gather gradient does, with colliding indices); ``sorted-scan``:
  the segmented scan of the GPU sparse update (`sorted_update`).
  """
  from embedlib.kernels import backward_mosaic, mosaic
  from embedlib.optim import sorted_update

  features = table.shape[1]
  grads = jax.random.normal(jax.random.PRNGKey(2), (ids_np.shape[0], features)).astype(table.dtype)
  ids = jnp.asarray(ids_np)

  def xla_sums(g, i):
    _, inverse = jnp.unique(i, size=i.shape[0], return_inverse=True)
    return jnp.zeros(g.shape, jnp.float32).at[inverse.reshape(-1)].add(g.astype(jnp.float32))

  def scan_sums(g, i):
    keys, order = jax.lax.sort((i, jnp.arange(i.shape[0])), num_keys=1)
    return sorted_update.segmented_sums(keys, g.astype(jnp.float32)[order])[0]

  ops = [("xla", xla_sums), ("sorted-scan", scan_sums)]
  on_cpu = jax.default_backend() == "cpu"   # --smoke: interpreted, where jax can
  if not on_cpu or mosaic.has_interpreter():
    row_sums = lambda g, i: backward_mosaic.row_sums(g, i, table.shape[0], interpret=on_cpu)
    ops.insert(1, ("mosaic", row_sums))
  uniq = len(np.unique(ids_np))
  moved = grads.size * grads.dtype.itemsize + uniq * features * 4
  results = {name: measure(timed_loop(op, args.inner, table.shape[0]), (grads, ids), args.inner,
                           args.repeats)
             for name, op in ops}
  base = float(np.median(results["xla"]))
  for name, secs in results.items():
    print(fmt_row(f"backward {label} {name}", secs, grads.size * grads.dtype.itemsize, moved,
                  copy_bw, base))
    keep_row(record, f"backward {label}", name, secs, base)


if __name__ == "__main__":
  sys.exit(main())
