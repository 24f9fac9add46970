"""``kernel="auto"``'s GPU table: generated from the newest GPU sweep's results, and obeyed.

The committed ``gpu_measured.py`` is what ``benchmarks/gpu_table.py`` makes
of the newest ``benchmarks/results/gpu_<date>.json`` (none yet: an empty
table, XLA's ops on every GPU lookup). A small fabricated results file (in
the test's temporary folder, never committed as a result) shows the rules:
a Triton variant is chosen where it beat the best XLA path on every
measured table and id distribution, by its worst speed-up; XLA's ops where
a variant lost anywhere or failed its check. Lowered for CUDA, ``auto``
then holds the chosen Triton kernels (forward and backward chosen apart)
and the fused update, and XLA's ops everywhere else.
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from embedlib import kernels, optim
from embedlib.kernels import gpu_choice
from embedlib.kernels.lowering import TRITON_CALL, cuda_lowering_text
from embedlib.optim import fused_gpu
from embedlib.plan import plan_embedding

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE_SCRIPT = ROOT / "benchmarks" / "gpu_table.py"
GATHER = "triton-rows-gather-r64-w8"
BAG = "triton-rows-bag-b4-u4-w2"
SEGMENT = "triton-rows-segment-p16-r32-u4-w8"


def case(kernel, variant, shape, dtype, ids, us, **extra):
  return dict(kernel=kernel, variant=variant, shape=list(shape), dtype=dtype, ids=ids,
              median_us=us, **extra)


def fabricated():
  """Two tables, two id distributions; medians chosen so each rule of the table shows."""
  cases = []
  for shape in ((1_000_000, 128), (10_000_000, 64)):
    for ids in ("uniform", "zipf"):
      # The gather: the rows kernel wins everywhere, by 1.5x at worst (f32 only).
      cases += [case("gather", "xla", shape, "float32", ids, 30.0),
                case("gather", GATHER, shape, "float32", ids, 20.0 if ids == "zipf" else 15.0),
                case("gather", "torch", shape, "float32", ids, 10.0),   # not runnable by auto
                case("gather", "xla", shape, "bfloat16", ids, 20.0),
                case("gather", GATHER, shape, "bfloat16", ids, 25.0)]
      # Bags of 16: faster than XLA's take + segment_sum, slower than xla-slots on Zipf.
      cases += [case("bag16", "xla", shape, "float32", ids, 40.0),
                case("bag16", "xla-slots", shape, "float32", ids, 30.0 if ids == "zipf" else 50.0),
                case("bag16", BAG, shape, "float32", ids, 35.0)]
      # Bags of 64: a variant that failed its check is never chosen.
      cases += [case("bag64", "xla", shape, "float32", ids, 80.0),
                case("bag64", BAG, shape, "float32", ids, 10.0, check=False)]
      # int8 rows: the rows kernel beats the quantized XLA lookup.
      cases += [case("gather", "xla", shape, "int8", ids, 30.0),
                case("gather", "triton-tile", shape, "int8", ids, 40.0),
                case("gather", GATHER, shape, "int8", ids, 12.0)]
      cases += [case("backward", "xla", shape, "float32", ids, 100.0),
                case("backward", SEGMENT, shape, "float32", ids, 50.0),
                case("update-sgd", "xla-sorted", shape, "float32", ids, 500.0),
                case("update-sgd", SEGMENT, shape, "float32", ids, 100.0)]
  return cases


@pytest.fixture(scope="module")
def table():
  return gpu_choice.table_from_results(fabricated())


def test_the_committed_table_is_the_newest_results_files():
  result = subprocess.run([sys.executable, str(TABLE_SCRIPT), "--check"], capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr


def test_generated_from_the_newest_file_of_a_results_folder(tmp_path):
  results = tmp_path / "results"
  results.mkdir()
  (results / "gpu_2026-01-01.json").write_text(json.dumps([]))
  (results / "gpu_2099-12-31.json").write_text(json.dumps(fabricated()))
  (results / "notes.json").write_text("not a results file")
  out = tmp_path / "gpu_measured.py"
  subprocess.run([sys.executable, str(TABLE_SCRIPT), "--results", str(results), "--out", str(out)],
                 check=True, capture_output=True, timeout=120)
  namespace = {}
  exec(out.read_text(), namespace)   # pylint: disable=exec-used
  assert namespace["SOURCE"] == "gpu_2099-12-31.json"
  rows = {(c[0], c[1], c[2], c[3]): c[4] for c in namespace["CHOICES"]}
  assert rows[("gather", "float32", (91, 256), (0, 0))] == GATHER
  check = subprocess.run([sys.executable, str(TABLE_SCRIPT), "--results", str(results), "--out",
                          str(out), "--check"], capture_output=True, timeout=120)
  assert check.returncode == 0


def test_a_confirming_rerun_of_the_same_date_must_agree(tmp_path):
  """The newest date's files are runs apart: a variant that lost in the rerun is not chosen."""
  results = tmp_path / "results"
  results.mkdir()
  first = fabricated()
  rerun = [dict(c, median_us=60.0) if c["variant"] == GATHER and c["dtype"] == "float32" else c
           for c in first if c["kernel"] == "gather"]   # the rerun measured the gathers alone
  (results / "gpu_2099-12-31.json").write_text(json.dumps(first))
  (results / "gpu_2099-12-31_confirm.json").write_text(json.dumps(rerun))
  out = tmp_path / "gpu_measured.py"
  subprocess.run([sys.executable, str(TABLE_SCRIPT), "--results", str(results), "--out", str(out)],
                 check=True, capture_output=True, timeout=120)
  namespace = {}
  exec(out.read_text(), namespace)   # pylint: disable=exec-used
  assert namespace["SOURCE"] == "gpu_2099-12-31.json, gpu_2099-12-31_confirm.json"
  rows = {(c[0], c[1], c[3]): c[4] for c in namespace["CHOICES"]}
  assert rows[("gather", "float32", (0, 0))] == "xla"      # 2x slower than XLA in the rerun
  assert rows[("gather", "int8", (0, 0))] == GATHER         # won in both runs
  assert rows[("backward", "float32", (0, 0))] == SEGMENT   # measured in the first run alone


def test_a_variant_is_chosen_by_its_worst_speedup_over_the_best_xla_path(table):
  choice = {(c.kind, c.dtype, c.features, c.bag): c for c in table}
  gather = choice["gather", "float32", (91, 256), (0, 0)]
  assert (gather.variant, gather.speedup) == (GATHER, 1.5)
  assert choice["gather", "float32", (32, 90), (0, 0)].variant == GATHER
  # bf16: slower than XLA; bags of 16: slower than xla-slots on Zipf ids.
  assert choice["gather", "bfloat16", (91, 256), (0, 0)].variant == "xla"
  assert choice["bag", "float32", (91, 256), (8, 32)].variant == "xla"
  # Failed its check: not chosen, however fast.
  assert choice["bag", "float32", (91, 256), (33, 128)].variant == "xla"
  assert choice["backward", "float32", (91, 256), (0, 0)].variant == SEGMENT
  assert choice["update-sgd", "float32", (32, 90), (0, 0)].speedup == 5.0


def test_choose_matches_width_bag_and_dtype(table):
  assert gpu_choice.choose("gather", 128, jnp.float32, table=table) == GATHER
  assert gpu_choice.choose("gather", 64, jnp.float32, table=table) == GATHER
  assert gpu_choice.choose("gather", 16, jnp.float32, table=table) is None   # not measured
  assert gpu_choice.choose("gather", 128, jnp.bfloat16, table=table) is None  # XLA faster
  assert gpu_choice.choose("gather", 128, jnp.float16, table=table) is None   # as bfloat16
  assert gpu_choice.choose("bag", 64, jnp.float32, bag=16, table=table) is None
  assert gpu_choice.choose("backward", 64, jnp.float32, table=table) == SEGMENT
  # The committed table: nothing measured yet, so XLA everywhere.
  if not gpu_choice._default_table():
    assert gpu_choice.runs_xla("gather", 128, jnp.float32)


TABLE = jax.ShapeDtypeStruct((1000, 128), jnp.float32)
IDS = jax.ShapeDtypeStruct((64, 16), jnp.int32)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_auto_lowers_the_chosen_kernels_for_cuda(table):
  def lookups(t, i):
    return kernels.gather(t, i[:, 0]).sum() + kernels.bag(t, i, combiner="mean").sum()

  grad = jax.value_and_grad(lookups)
  assert TRITON_CALL not in cuda_lowering_text(grad, TABLE, IDS)   # the committed table: XLA
  with gpu_choice.using(table):
    text = cuda_lowering_text(grad, TABLE, IDS)
    cpu_text = jax.jit(grad).lower(TABLE, IDS).as_text()
  # The gather's forward and every backward are the rows kernels; bags of 16 are XLA's.
  assert "embedlib_gather_rows" in text and "embedlib_segment_rows" in text
  assert "embedlib_bag_rows" not in text
  assert TRITON_CALL not in cpu_text   # a CPU lowering keeps the CPU's kernels


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_auto_lowers_the_quantized_rows_kernel_where_measured_faster(table):
  import numpy as np

  from embedlib.quant import format as fmt, lookup

  quantized = fmt.quantize_table(np.ones((100, 128), np.float32), bits=8)
  ids = jnp.arange(64)
  assert gpu_choice.choose("gather", 128, "int8", table=table) == GATHER
  with gpu_choice.using(table):
    text = cuda_lowering_text(lambda q, i: lookup.gather(q, i), quantized, ids)
  assert "embedlib_quantized_gather_rows" in text
  assert "embedlib_quantized_gather_rows" not in cuda_lowering_text(
      lambda q, i: lookup.gather(q, i), quantized, ids)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_auto_runs_the_fused_update_where_measured_faster(table):
  plan = plan_embedding(1000, 64)
  rule = optim.SparseSGD(0.1)
  shard = jnp.zeros((1000, 64))
  assert not fused_gpu.supports(rule, shard, plan)
  with gpu_choice.using(table):
    assert fused_gpu.supports(rule, shard, plan)
    assert not fused_gpu.supports(optim.RowWiseAdagrad(0.1), shard, plan)   # not measured
    ids = jax.ShapeDtypeStruct((256,), jnp.int32)
    grads = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    slots = optim.init_slots(rule, plan, None)
    from embedlib.optim import sorted_update

    with sorted_update.use(True):
      text = cuda_lowering_text(
          lambda t, i, g: optim.apply_row_grads(rule, t, slots, [(i, g)], plan=plan, mesh=None,
                                                step=0),
          jax.ShapeDtypeStruct((1000, 64), jnp.float32), ids, grads)
  assert "embedlib_segment_rows" in text
