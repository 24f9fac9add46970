"""The many-rows-in-flight Triton kernels as compiled for sm_90a, read without a GPU, with their roofline.

Run where the deviceless GPU compiles run (Python 3.12, ``pip install -e
'.[gpu-compile]'``)::

  JAX_PLATFORMS=cpu python benchmarks/gpu_static.py
  JAX_PLATFORMS=cpu python benchmarks/gpu_static.py --kernels gather,bag16 --json static.json

For each kernel (its default variant, ``kernels/rows.default_variant``) and
dtype, at the sweep's two tables (1M x 128 and 10M x 64) and 65,536 ids, it
compiles the lookup for an H100 (``embedlib.kernels.deviceless``; the
H200's code is the same sm_90a code) and prints one line, from the compiled
code (``embedlib.kernels.ptx``):

- ``loads``: the kernel's global loads by width, ``16Bx8`` = eight 16-byte
  ``ld.global.v4`` a thread;
- ``regs`` / ``spill``: registers per thread and spilled bytes (ptxas -v);
- ``smem``, ``threads``, ``grid``: shared memory, threads per block and
  programs, as XLA launches the kernel;
- ``occ``: theoretical occupancy (resident warps / 64, from registers,
  shared memory and threads against a Hopper SM's limits), and ``waves``:
  the grid over what the 132 SMs hold at once;
- ``flight``: kilobytes the resident programs request at once, if each
  issues one step's loads before it uses them (`ptx.Kernel.in_flight`:
  the loads a thread's code holds, times threads, times the programs
  resident on the 132 SMs). Little's law: moving ``B`` bytes a second at
  a loaded memory latency ``L`` needs ``B x L`` bytes in flight;
- ``MB``: the fewest bytes the call must move (each input read once, each
  output written once: table rows read, output written, ids; for the
  backward and the update the distinct rows of uniform / Zipf(1.05) ids);
- ``H100 us`` / ``H200 us``: those bytes at 3.35 and 4.8 TB/s (the
  datasheets'), the time no kernel can beat (``benchmarks/README.md`` adds
  the rate a device-to-device copy reached, which the targets count in).

Nothing is timed. ``benchmarks/README.md`` ("Triton rows kernels: compiled
code and roofline") keeps the table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import timing  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

TABLES = ((1_000_000, 128), (10_000_000, 64))
NUM_IDS = 65_536
KERNELS = ("gather", "bag16", "bag64", "backward", "update-sgd", "update-adagrad", "update-adam")
DTYPES = {"gather": ("float32", "bfloat16", "int8", "int4"), "bag16": ("float32", "bfloat16",
                                                                      "int8", "int4"),
          "bag64": ("float32", "bfloat16", "int8", "int4"), "backward": ("float32", "bfloat16")}
UPDATE_SLOTS = {"update-sgd": 0, "update-adagrad": 1, "update-adam": 2}   # table-sized slots


def make_ids(rows, n, distribution, seed=0):
  """The sweep's ids (``gpu_lookup.make_ids``): uniform, or Zipf(1.05) hashed over the table."""
  rng = np.random.default_rng(seed)
  if distribution == "uniform":
    return rng.integers(0, rows, n, dtype=np.int64).astype(np.int32)
  ranks = (rng.zipf(1.05, n) - 1) % rows
  return ((ranks * 2_654_435_761) % rows).astype(np.int32)


def distinct(rows: int) -> dict[str, int]:
  return {d: len(np.unique(make_ids(rows, NUM_IDS, d))) for d in ("uniform", "zipf")}


def row_bytes(dtype: str, features: int) -> int:
  """Bytes of one stored row (int8 / int4: codes plus a float16 scale and bias)."""
  if dtype in ("int8", "int4"):
    return (features if dtype == "int8" else features // 2) + 4
  return features * jnp.dtype(dtype).itemsize


def moved_bytes(kernel: str, dtype: str, rows: int, features: int, uniq: int,
                n: int = NUM_IDS) -> int:
  """The fewest bytes a call of ``n`` ids moves (see the module docstring)."""
  rb = row_bytes(dtype, features)
  out_item = 4 if dtype in ("int8", "int4") else jnp.dtype(dtype).itemsize
  if kernel == "gather":
    return n * rb + n * features * out_item + 4 * n
  if kernel.startswith("bag"):
    return n * rb + n // int(kernel[3:]) * features * out_item + 4 * n
  if kernel == "backward":   # gradient rows and ids read; one float32 row per distinct id written
    return n * rb + 4 * n + uniq * features * 4
  per_row = features * 4 * (1 + UPDATE_SLOTS[kernel]) + (4 if kernel != "update-sgd" else 0)
  return n * features * 4 + 4 * n + 2 * uniq * per_row


def program(kernel: str, dtype: str, rows: int, features: int, mesh):
  """``(fn, abstract args)`` of one kernel's lookup at the default variant."""
  from embedlib.kernels import rows as rows_lib
  from embedlib.kernels import segment_rows, update_rows
  from embedlib.kernels.bag_rows import bag_rows
  from embedlib.kernels.gather_rows import gather_rows
  from embedlib.quant import bag_rows as quant_rows
  from embedlib.quant import format as fmt

  rep = NamedSharding(mesh, P())
  S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=rep)
  n, rb = NUM_IDS, row_bytes(dtype, features)
  if kernel.startswith("update"):
    rule = kernel.split("-")[1]
    variant = rows_lib.default_variant("segment", features * 4, n)
    table = S((rows, features), jnp.float32)
    slots = [table] * len(update_rows.TABLE_SLOTS[rule])
    per_run = [S((n,), jnp.float32)] * update_rows.PER_RUN[rule]
    vec = S((n,), jnp.int32)

    def update(table, slots, per_run, grads, src, starts, ends, rows_):
      return update_rows.fused_update(table, grads, src, starts, ends, rows_, 0.01, rule=rule,
                                      table_slots=tuple(slots), per_run=tuple(per_run), eps=1e-8,
                                      b1=0.9, b2=0.999, features=features, variant=variant)

    return update, (table, slots, per_run, S((n, features), jnp.float32), vec, vec, vec, vec)
  if kernel == "backward":
    variant = rows_lib.default_variant("segment", rb, n, itemsize=jnp.dtype(dtype).itemsize)
    fn = lambda g, i: segment_rows.row_sums(g, i, rows, variant=variant)
    return fn, (S((n, features), dtype), S((n,), jnp.int32))
  bag = int(kernel[3:]) if kernel.startswith("bag") else 1
  ids = S((n // bag, bag), jnp.int32) if bag > 1 else S((n,), jnp.int32)
  if dtype in ("int8", "int4"):
    bits = 8 if dtype == "int8" else 4
    table = fmt.QuantizedTable(S((rows, fmt.block_bytes(bits, features)), jnp.uint8),
                               S((rows, 1, 2), jnp.float16), bits, features)
    if bag > 1:
      variant = rows_lib.default_variant("bag", rb, n // bag)
      return lambda t, i: quant_rows.bag_rows(t, i, variant=variant), (table, ids)
    variant = rows_lib.default_variant("gather", rb, n)
    return lambda t, i: quant_rows.gather_rows(t, i, variant=variant), (table, ids)
  table = S((rows, features), dtype)
  if bag > 1:
    variant = rows_lib.default_variant("bag", rb, n // bag)
    return lambda t, i: bag_rows(t, i, variant=variant), (table, ids)
  variant = rows_lib.default_variant("gather", rb, n)
  return lambda t, i: gather_rows(t, i, variant=variant), (table, ids)


def widths(counter) -> str:
  return ",".join(f"{b}Bx{c}" for b, c in sorted(counter.items(), reverse=True)) or "-"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated; "
                      f"of {','.join(KERNELS)}")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  from embedlib.kernels import deviceless, ptx

  reason = deviceless.unavailable_reason()
  if reason:
    print(f"gpu_static: deviceless GPU compiles unavailable: {reason}")
    return 0
  record = timing.Run("gpu_static", argv)
  mesh = deviceless.gpu_mesh((1,), ("x",), target="H100")
  print(f"jax {jax.__version__}, compiled for sm_90a (H100 / H200), {NUM_IDS:,} ids; default "
        "variants (kernels/rows.default_variant)")
  header = (f"{'kernel':<15}{'dtype':<9}{'table':<9}{'name':<29}{'loads':<17}{'regs':>5}"
            f"{'spill':>6}{'smem':>7}{'thr':>5}{'grid':>7}{'occ':>6}{'waves':>6}{'flight':>8}"
            f"{'MB':>14}{'H100 us':>14}{'H200 us':>14}")
  print(header)
  records = []
  for kernel in args.kernels.split(","):
    for dtype in DTYPES.get(kernel, ("float32",)):
      for rows, features in TABLES:
        uniq = distinct(rows)
        fn, abstract = program(kernel, dtype, rows, features, mesh)
        found = ptx.compiled_kernels(fn, *abstract, mesh=mesh)
        moved = {d: moved_bytes(kernel, dtype, rows, features, u) for d, u in uniq.items()}
        spread = len(set(moved.values())) > 1
        fmt_pair = lambda f: (f"{f(moved['uniform']):.1f}/{f(moved['zipf']):.1f}" if spread
                              else f"{f(moved['uniform']):.1f}")
        table = f"{rows // 10**6}Mx{features}"
        for name, k in sorted(found.items()):
          line = (f"{kernel:<15}{dtype:<9}{table:<9}{name.removeprefix('embedlib_'):<29}"
                  f"{widths(k.loads):<17}{k.registers:>5}{k.spill_stores + k.spill_loads:>6}"
                  f"{k.shared:>7}{k.threads:>5}{k.grid:>7}{k.occupancy():>6.0%}{k.waves():>6.1f}"
                  f"{k.in_flight() // 1024:>7}K"
                  f"{fmt_pair(lambda b: b / 1e6):>14}"
                  f"{fmt_pair(lambda b: ptx.roofline_us(b, 'H100')):>14}"
                  f"{fmt_pair(lambda b: ptx.roofline_us(b, 'H200')):>14}")
          print(line, flush=True)
          record.add_case(f"{kernel} {dtype} {table} {name.removeprefix('embedlib_')} H200 floor",
                          [ptx.roofline_us(b, "H200") for b in moved.values()], "us")
          record.cases[-1].update(
              kernel=kernel, dtype=dtype, shape=[rows, features], kernel_name=name,
              loads={str(b): c for b, c in k.loads.items()}, registers=k.registers,
              spills=k.spill_stores + k.spill_loads, shared=k.shared, threads=k.threads,
              grid=k.grid, occupancy=k.occupancy(), waves=k.waves(),
              in_flight_bytes=k.in_flight(), moved_bytes=moved,
              roofline_us={t: {d: ptx.roofline_us(b, t) for d, b in moved.items()}
                           for t in ptx.HBM})
          records.append(record.cases[-1])
  spilled = [f"{r['kernel']} {r['dtype']} {r['kernel_name']}" for r in records
             if r["spills"]]
  print(f"\nspills: {', '.join(spilled) if spilled else 'none'}")
  print("loads: global load width x count a thread (PTX); MB and us: uniform/zipf ids where "
        "they differ (distinct rows). The us columns are the bandwidth floor, not a timing.")
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
