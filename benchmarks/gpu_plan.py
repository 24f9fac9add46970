"""Per-device HBM on 8 x H200 from deviceless compiles, beside the planner's estimate.

    JAX_PLATFORMS=cpu python benchmarks/gpu_plan.py            # every part
    JAX_PLATFORMS=cpu python benchmarks/gpu_plan.py --only llm
    JAX_PLATFORMS=cpu python benchmarks/gpu_plan.py --only memory --configs quickstart,ranker
    JAX_PLATFORMS=cpu python benchmarks/gpu_plan.py --json run.json   # also the run's record

Needs the CUDA plugin (``pip install -e '.[gpu-compile]'``, Python >= 3.12);
nothing runs on a GPU: every figure is XLA's ``memory_analysis()`` of a
program compiled for 8 H200s (``embedlib.kernels.deviceless``), per device:
arguments, temporaries, and the total the program holds at once
(arguments + outputs not aliased to them + temporaries). "planned" is the
plan's memory of the embedding's step (``embedlib.plan.memory``: tables,
row-wise slots, ids and the lookups' and sparse update's temporaries) summed
over the tables; a whole train step holds the dense weights, their moments
and the batch beside it.

0. ``memory``: each config of ``configs/`` at its documented size (and
   ``:smoke``), and the MLPerf DLRM-DCNv2 below: its lookups and sparse
   step alone (``tests/gpu_compile/embedding_steps.py``), compiled, beside
   the plan: tables + slots + ids against the arguments, the planned
   temporaries against XLA's, and the totals. ``--configs grid``: one
   200,000 x 64 table alone on a 2 x 4 data x model mesh, as a grid, vocab
   and hidden.

1. ``dlrm``: MLPerf DLRM-DCNv2 on Criteo 1TB (26 tables, the MLPerf
   cardinalities capped at 40M rows: 204M rows, width 128; 3 cross layers,
   bottom 512-256-128, top 1024-1024-512-256-1, global batch 65536,
   row-wise AdaGrad): the train step as ``train`` builds it from the DLRM
   config (the planner's layout per table), then the sparse step of its
   tables alone in each layout (every table ``vocab``, ``routed``, or
   table-wise stacks).
2. ``llm``: a 262,144 x 1024 float32 tied embedding: token lookup, tied
   output layer and ``vocab_parallel_cross_entropy``, gradient of the
   table, 8192 tokens a device; vocab-parallel over 8, and 2 x 4 data x
   model. (Not 2048 or wider: the Mosaic GPU lookups' row blocks then
   overflow an H100's shared memory, see ``tests/gpu_compile/test_kernels.py``.)
3. ``largest``: per layout, the largest 128-wide table whose sparse step
   (row-wise AdaGrad, 65536 ids a step) fits one H200: the step compiled at
   two sizes, the bytes per row between them, extrapolated to the HBM, then
   compiled at that size to check.

``--json FILE`` keeps every program's compiled total (and the plan's, where
there is one) in MiB in ``benchmarks/timing.py``'s record, with the ratio
``plan_over_compiled_<program>`` for each planned one, and each layout's
largest table (``largest``, M rows); nothing is timed.

The pipelined step's schedule (which compute XLA places between the next
batch's all-to-all start and done): ``benchmarks/pipeline_schedule.py``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import re
import sys
import time

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import timing
import embedlib
from embedlib import CollectionLayout, EmbeddingCollection, FeatureSpec, TableSpec, optim
from embedlib.kernels import deviceless
from embedlib.plan import memory

TARGET = "H200"
GIB = 2**30
#: MLPerf DLRM-DCNv2's Criteo 1TB cardinalities (max_ind_range 40M).
MLPERF_CARDINALITIES = (
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956,
    405_282, 10, 2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152,
    12_973, 108, 36)
WIDTH = 128
BATCH = 65536
#: The collections' settings: every table the planner's, none replicated for being small.
COLLECTION_LAYOUT = CollectionLayout(kernel="auto", replicate_below_bytes=0, batch_size=BATCH)


def total_bytes(memory) -> int:
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes + memory.temp_size_in_bytes)


def row(name, memory, planned=None, seconds=None) -> str:
  planned_s = f"{planned / GIB:9.2f}" if planned is not None else f"{'-':>9s}"
  took = f"{seconds:6.0f} s" if seconds is not None else ""
  return (f"  {name:34s} {memory.argument_size_in_bytes / GIB:9.2f} "
          f"{memory.temp_size_in_bytes / GIB:9.2f} {total_bytes(memory) / GIB:9.2f} "
          f"{planned_s}  {took}")


def keep(record, name, compiled_memory, planned=None) -> None:
  """``name``'s compiled total (and the plan's, with their ratio) in ``record``."""
  total = total_bytes(compiled_memory)
  record.add_case(f"{name}: compiled total", total / 2**20, "MiB")
  if planned is not None:
    record.add_case(f"{name}: planned total", planned / 2**20, "MiB")
    tag = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    record.ratio(f"plan_over_compiled_{tag}", planned / total)


HEADER = (f"  {'program':34s} {'args GiB':>9s} {'temp GiB':>9s} {'total GiB':>9s} "
          f"{'planned':>9s}  compile")


def sparse_step(graphdef, state, inputs, loss_fn, mesh):
  """The sparse train step, compiled: ``(compiled, seconds)``."""
  def step(state, inputs):
    module, opt = nnx.merge(graphdef, state)
    loss, grads = optim.value_and_grad(lambda m: loss_fn(m, inputs))(module)
    opt.update(module, grads)
    return loss, nnx.state((module, opt))

  start = time.perf_counter()
  compiled = deviceless.gpu_compile(step, state, inputs, mesh=mesh, donate_argnums=0)
  return compiled, time.perf_counter() - start


def abstract_pair(build, mesh):
  """``(pair, graphdef, abstract state)`` of ``build()``, sharded as a concrete build places it."""
  from tests.gpu_compile import compiled, embedding_steps  # pylint: disable=g-import-not-at-top

  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    pair = nnx.eval_shape(build)
  graphdef, state = nnx.split(pair)
  return pair, graphdef, embedding_steps.tables_placed(pair, compiled.abstract(state, mesh), mesh)


def planned_bytes(coll) -> int:
  """The plan's memory of the collection's sparse step (row-wise AdaGrad), per device."""
  plans = [t.plan for t in coll.plan.tables if t.stack is None] + [s.plan for s in coll.plan.stacks]
  return memory.device_memory(plans, "rowwise_adagrad").total


MEMORY_CONFIGS = ("quickstart", "dlrm_criteo", "ranker", "two_tower")


def plan_memory(names, record) -> None:
  """Each config's embedding step alone, compiled, beside the plan's memory of it."""
  from tests.gpu_compile import embedding_steps, train_steps  # pylint: disable=g-import-not-at-top

  print(f"Embedding step alone (lookups + sparse step), per device, 8 x {TARGET}")
  print(f"  {'config':24s} {'args MiB':>10s} {'planned':>10s} {'temp MiB':>10s} {'planned':>10s} "
        f"{'total MiB':>10s} {'planned':>10s} {'plan/compiled':>13s}  compile")
  configs = []
  for name in names:
    if name in ("mlperf", "grid"):
      configs.append(("MLPerf DLRM-DCNv2", dlrm_config()) if name == "mlperf" else ("grid", None))
      continue
    module = importlib.import_module(f"configs.{name}")
    configs += [(f"{name}:smoke", module.get_config("smoke")), (name, module.get_config(None))]
  for label, config in configs:
    if label == "grid":
      grid_memory(record)
      continue
    mesh = train_steps.mesh_for(config, TARGET)
    step, state, inputs, plans = embedding_steps.embedding_step(config, mesh)
    start = time.perf_counter()
    compiled = deviceless.gpu_compile(step, state, inputs, mesh=mesh, donate_argnums=0,
                                      compiler_options={"xla_gpu_autotune_level": 0})
    planned = memory.device_memory(plans, config.optim.sparse.name)
    print(memory_row(label, compiled.memory_analysis(), planned, time.perf_counter() - start),
          flush=True)
    keep(record, f"memory {label}", compiled.memory_analysis(), planned.total)


def memory_row(label, m, planned, seconds) -> str:
  """One row of ``plan_memory``: compiled and planned arguments, temporaries and totals."""
  mib = lambda n: f"{n / 2**20:10.3f}"
  arguments = planned.table + planned.slots + planned.ids
  return (f"  {label:24s} {mib(m.argument_size_in_bytes)} {mib(arguments)}"
          f" {mib(m.temp_size_in_bytes)} {mib(planned.temporary)} {mib(total_bytes(m))}"
          f" {mib(planned.total)} {100 * (planned.total / total_bytes(m) - 1):+12.1f}%  "
          f"{seconds:5.0f} s")


GRID_ROWS, GRID_WIDTH, GRID_IDS = 200_000, 64, 4096


def grid_memory(record) -> None:
  """One table alone on a 2 x 4 data x model mesh, its ids replicated over its group.

  A grid (rows over ``model``, columns over ``data``), vocab and hidden;
  row-wise AdaGrad, ``GRID_IDS`` ids a device, the rows' sum of squares.
  """
  mesh = deviceless.gpu_mesh((2, 4), ("data", "model"), target=TARGET,
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
  for layout in ("grid", "vocab", "hidden"):
    def build(layout=layout):
      e = embedlib.ShardedEmbed(GRID_ROWS, GRID_WIDTH, mesh=mesh, layout=embedlib.Layout(
          sharding=layout, table_axes=("model",), data_axes=("data",),
          ids_per_device=GRID_IDS), rngs=nnx.Rngs(0))
      return e, optim.SparseAwareOptimizer(e, None, optim.RowWiseAdagrad(0.05))

    (emb, _), graphdef, state = abstract_pair(build, mesh)
    ids = jax.ShapeDtypeStruct((GRID_IDS * emb.plan.data_shards,), jnp.int32,
                               sharding=NamedSharding(mesh, P("data")))

    def step(state, ids):
      e, opt = nnx.merge(graphdef, state)
      loss, grads = optim.value_and_grad(lambda m: jnp.sum(m(ids) ** 2))(e)
      opt.update(e, grads)
      return loss, nnx.state((e, opt))

    start = time.perf_counter()
    compiled = deviceless.gpu_compile(step, state, ids, mesh=mesh, donate_argnums=0,
                                      compiler_options={"xla_gpu_autotune_level": 0})
    planned = memory.device_memory([(emb.plan, GRID_IDS, None, GRID_IDS)], "rowwise_adagrad")
    print(memory_row(f"2 x 4, {layout}", compiled.memory_analysis(), planned,
                     time.perf_counter() - start), flush=True)
    keep(record, f"memory 2 x 4 {layout}", compiled.memory_analysis(), planned.total)


def dlrm_config():
  from configs import dlrm_criteo  # pylint: disable=g-import-not-at-top

  config = dlrm_criteo.get_config()
  config.data.table_sizes = MLPERF_CARDINALITIES
  config.model.update(name="dcn", embed_dim=WIDTH, cross_layers=3, bottom_sizes=(512, 256),
                      top_sizes=(1024, 1024, 512, 256, 1))
  config.batch_size = BATCH
  return config


def dlrm(mesh, record) -> None:
  from tests.gpu_compile import train_steps  # pylint: disable=g-import-not-at-top

  config = dlrm_config()
  print(f"DLRM-DCNv2 (MLPerf Criteo 1TB): {sum(MLPERF_CARDINALITIES):,} rows x {WIDTH}, "
        f"batch {BATCH}, 8 x {TARGET}")
  print(HEADER)
  step, state, batch = train_steps.train_step(config, mesh)
  start = time.perf_counter()
  compiled = deviceless.gpu_compile(step, state, batch, mesh=mesh, donate_argnums=0)
  seconds = time.perf_counter() - start
  # The planner's figure for the same tables (the model's collection plans them alike).
  spec_tables = [TableSpec(f"C{i + 1}", n, WIDTH) for i, n in enumerate(MLPERF_CARDINALITIES)]
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    coll = nnx.eval_shape(lambda: EmbeddingCollection(
        spec_tables, [FeatureSpec(t.name, t.name, max_ids_per_sample=1) for t in spec_tables],
        mesh=mesh, layout=COLLECTION_LAYOUT, rngs=nnx.Rngs(0)))
  print(row("train step (planner's layouts)", compiled.memory_analysis(), planned_bytes(coll),
            seconds))
  keep(record, "dlrm train step", compiled.memory_analysis(), planned_bytes(coll))
  for layout in ("vocab", "routed", "table"):
    tables = [TableSpec(t.name, t.num_embeddings, WIDTH, sharding=layout) for t in spec_tables]
    features = [FeatureSpec(t.name, t.name, max_ids_per_sample=1) for t in tables]

    def build():
      c = EmbeddingCollection(tables, features, mesh=mesh, layout=COLLECTION_LAYOUT,
                              rngs=nnx.Rngs(0))
      return c, optim.SparseAwareOptimizer(c, None, optim.RowWiseAdagrad(0.05))

    try:
      (coll, _), graphdef, state = abstract_pair(build, mesh)
    except ValueError as e:
      print(f"  tables {layout}: not buildable ({str(e).splitlines()[0][:120]})")
      continue
    ids = {t.name: jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=NamedSharding(mesh, P("batch")))
           for t in tables}
    loss = lambda c, f: sum(jnp.sum(v**2) for v in c(f).values())
    compiled, seconds = sparse_step(graphdef, state, ids, loss, mesh)
    print(row(f"tables' sparse step, {layout}", compiled.memory_analysis(), planned_bytes(coll),
              seconds))
    keep(record, f"dlrm tables' sparse step {layout}", compiled.memory_analysis(),
         planned_bytes(coll))


LLM_VOCAB, LLM_WIDTH, LLM_TOKENS = 262_144, 1024, 8192


def llm(target, record) -> None:
  print(f"LLM tied embedding {LLM_VOCAB:,} x {LLM_WIDTH} float32, vocab-parallel loss, "
        f"{LLM_TOKENS} tokens a device, 8 x {target}")
  print(HEADER)
  for data, model in ((1, 8), (2, 4)):
    names = ("model",) if data == 1 else ("data", "model")
    mesh = deviceless.gpu_mesh((8,) if data == 1 else (data, model), names, target=target)
    tokens_axis = "data" if data > 1 else None
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      emb = nnx.eval_shape(lambda: embedlib.ShardedEmbed(
          LLM_VOCAB, LLM_WIDTH, mesh=mesh, layout=embedlib.Layout(sharding="vocab", tied=True),
          rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(emb)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                         state)
    split = NamedSharding(mesh, P(tokens_axis))
    tokens = LLM_TOKENS * data
    ids = jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=split)
    labels = jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=split)

    def step(state, ids, labels):
      def loss(state):
        emb = nnx.merge(graphdef, state)
        logits = emb.attend(emb(ids), out_sharding=P(tokens_axis, "model"))
        return embedlib.vocab_parallel_cross_entropy(logits, labels, reduction="mean")

      return jax.value_and_grad(loss)(state)

    start = time.perf_counter()
    compiled = deviceless.gpu_compile(step, state, ids, labels, mesh=mesh)
    print(row(f"vocab, {data} x {model} data x model", compiled.memory_analysis(),
              emb.plan.bytes_per_device, time.perf_counter() - start))
    keep(record, f"llm vocab {data} x {model}", compiled.memory_analysis(),
         emb.plan.bytes_per_device)


ID_LIMIT = (2**31 - 1) // 1_000_000 * 1_000_000
LARGEST_LAYOUTS = ("replicated", "vocab", "hidden", "routed", "table")


def largest(mesh, record) -> None:
  hbm = deviceless.device_memory_bytes(TARGET)
  print(f"Largest {WIDTH}-wide float32 table a layout trains (row-wise AdaGrad, {BATCH} ids a "
        f"step) on 8 x {TARGET} ({hbm / GIB:.1f} GiB each)")
  ids = jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=NamedSharding(mesh, P("batch")))

  def total(layout, rows):
    def build():
      c = EmbeddingCollection([TableSpec("t", rows, WIDTH, sharding=layout)],
                              [FeatureSpec("t", "t", max_ids_per_sample=1)], mesh=mesh,
                              layout=COLLECTION_LAYOUT, rngs=nnx.Rngs(0))
      return c, optim.SparseAwareOptimizer(c, None, optim.RowWiseAdagrad(0.05))

    _, graphdef, state = abstract_pair(build, mesh)
    compiled, _ = sparse_step(graphdef, state, {"t": ids},
                              lambda c, f: jnp.sum(c(f)["t"] ** 2), mesh)
    return total_bytes(compiled.memory_analysis())

  step = 1 << 24
  for layout in LARGEST_LAYOUTS:
    a, b = total(layout, step), total(layout, 2 * step)
    per_row = (b - a) / step
    rows = int(step + (hbm - a) / per_row) // 1_000_000 * 1_000_000
    # int32 ids (x64 off) address 2**31 - 1 rows: past that, the table is the ids' limit.
    capped = rows > ID_LIMIT
    rows = min(rows, ID_LIMIT)
    try:
      fits = total(layout, rows)
    except ValueError as e:   # the library's own limits (the plan's int32 rows), reported
      print(f"  {layout:11s} {per_row:7.1f} B/row a device -> {rows / 1e6:8,.0f}M rows does not "
            f"build: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
      continue
    print(f"  {layout:11s} {per_row:7.1f} B/row a device -> {rows / 1e6:8,.0f}M rows "
          f"({rows * WIDTH * 4 / GIB:7.1f} GiB of table{'; int32 ids limit' if capped else ''}); "
          f"compiled there: {fits / GIB:6.1f} GiB a device "
          f"{'fits' if fits <= hbm else 'DOES NOT FIT'}")
    record.add_case(f"largest {layout}: rows", rows / 1e6, "M rows")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", choices=["memory", "dlrm", "llm", "largest"], action="append")
  parser.add_argument("--configs", default=",".join(MEMORY_CONFIGS + ("grid", "mlperf")),
                      help="memory: configs/ modules (and mlperf; grid: one table on a "
                           "2 x 4 mesh in a grid, vocab and hidden), comma-separated")
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  reason = deviceless.unavailable_reason()
  if reason:
    print(f"gpu_plan: {reason}")
    return 1
  record = timing.Run("gpu_plan", argv)
  parts = args.only or ["memory", "dlrm", "llm", "largest"]
  if "memory" in parts:
    plan_memory(args.configs.split(","), record)
  mesh = deviceless.gpu_mesh((8,), ("batch",), target=TARGET,
                             axis_types=(jax.sharding.AxisType.Auto,))
  if "llm" in parts:
    llm(TARGET, record)
  if "largest" in parts:
    largest(mesh, record)
  if "dlrm" in parts:
    dlrm(mesh, record)
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
