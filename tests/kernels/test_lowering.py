"""Every kernel, forward and gradient, lowers for CUDA on this CPU machine, on both backends.

This is the CI proof that the GPU path builds (see ``embedlib/kernels/lowering.py``),
for the Mosaic GPU kernels (``mosaic_gpu_v2`` custom calls) and the Triton
ones (``__gpu$xla.gpu.triton``), on jax 0.10 and the newest jax. The kernels
are named (``embedlib_gather``, ``embedlib_bag``, ``embedlib_segment_sum``,
with ``_mosaic`` for Mosaic GPU) and the names show in the lowered text, so
each test checks that the right kernel, not just any GPU call, is there.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import axes, kernels, options
from embedlib.kernels.lowering import (MOSAIC_GPU_CALL, TRITON_CALL, cuda_lowering_text,
                                       gpu_abstract_mesh)
from tests import covering

S = jax.ShapeDtypeStruct
# A width that is not a power of two, in rows of whole 128-byte units (what
# jax 0.10's Mosaic GPU copies need).
TABLE = S((1000, 192), jnp.float32)
IDS = S((37, 5), jnp.int32)
WEIGHTS = S((37, 5), jnp.float32)
BACKENDS = ["mosaic", "triton"]
CALLS = {"mosaic": MOSAIC_GPU_CALL, "triton": TRITON_CALL}


def assert_kernels(text, backend, *names):
  assert CALLS[backend] in text
  other = CALLS["triton" if backend == "mosaic" else "mosaic"]
  assert other not in text
  for name in names:
    name = name + "_mosaic" if backend == "mosaic" else name
    assert name in text, f"kernel {name} missing from the CUDA lowering"


# CI: Mosaic in float32, Triton in bfloat16 (tests/gpu_compile compiles
# Mosaic's in both); -m slow: all 4.
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("dtype,backend", [
    pytest.param(d, b, marks=() if (d, b) in {(jnp.float32, "mosaic"), (jnp.bfloat16, "triton")}
                 else pytest.mark.slow)
    for d in (jnp.float32, jnp.bfloat16) for b in BACKENDS])
def test_gather_forward_and_grad_lower_for_cuda(backend, dtype):
  table = S(TABLE.shape, dtype)
  text = cuda_lowering_text(lambda t, i: kernels.gather(t, i, kernel=backend), table, IDS)
  assert_kernels(text, backend, "embedlib_gather")
  assert "embedlib_segment_sum" not in text
  grad = jax.grad(lambda t, i: kernels.gather(t, i, kernel=backend).astype(jnp.float32).sum())
  assert_kernels(cuda_lowering_text(grad, table, IDS), backend, "embedlib_segment_sum")


# Every pair of values in CI (6 cases); -m slow: all 12.
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("weighted,combiner,backend",
                         covering.params([False, True], options.COMBINERS, BACKENDS))
def test_bag_forward_and_grad_lower_for_cuda(backend, combiner, weighted):
  def pooled(t, i, w):
    return kernels.bag(t, i, w if weighted else None, combiner=combiner, kernel=backend)

  assert_kernels(cuda_lowering_text(pooled, TABLE, IDS, WEIGHTS), backend, "embedlib_bag")
  grad = jax.grad(lambda t, i, w: pooled(t, i, w).sum(), argnums=(0, 2))
  assert_kernels(cuda_lowering_text(grad, TABLE, IDS, WEIGHTS), backend, "embedlib_segment_sum")


def test_pallas_kernel_lowers_for_gpu_compiled():
  """kernel="pallas" lowered for CUDA holds this jax's Pallas backend, compiled."""
  text = cuda_lowering_text(lambda t, i: kernels.gather(t, i, kernel="pallas"), TABLE, IDS)
  assert_kernels(text, kernels.pallas_backend(), "embedlib_gather")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_auto_kernel_lowers_to_xla_ops_for_gpu(dtype):
  """kernel="auto" on CUDA: XLA's gather and bag, measured faster on an H200 (`gpu_choice`)."""
  table = S(TABLE.shape, dtype)
  lookups = lambda t, i: (kernels.gather(t, i), kernels.bag(t, i))
  text = cuda_lowering_text(lookups, table, IDS)
  assert MOSAIC_GPU_CALL not in text and TRITON_CALL not in text
  assert "stablehlo.gather" in text


def test_mosaic_kernels_leave_unaligned_rows_to_xla():
  """Rows that are not whole copy units (3 floats) lower to XLA's gather, no GPU kernel."""
  text = cuda_lowering_text(lambda t, i: kernels.gather(t, i, kernel="mosaic"),
                            S((1000, 3), jnp.float32), IDS)
  assert MOSAIC_GPU_CALL not in text and "stablehlo.gather" in text


def test_vocab_parallel_shard_map_lowers_with_mosaic_and_all_reduce():
  mesh = gpu_abstract_mesh((2, 4), (axes.DATA, axes.MODEL))

  def body(local, ids):
    offset = jax.lax.axis_index(axes.MODEL) * local.shape[0]
    rows = kernels.gather(local, ids - offset, kernel="mosaic", interpret=False)
    return jax.lax.psum(rows, axes.MODEL)

  def lookup(table, ids):
    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axes.MODEL), P(axes.DATA)), out_specs=P(axes.DATA)
    )(table, ids)

  table = S((1024, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P(axes.MODEL)))
  ids = S((32,), jnp.int32, sharding=NamedSharding(mesh, P(axes.DATA)))
  text = cuda_lowering_text(lookup, table, ids, mesh=mesh)
  assert_kernels(text, "mosaic", "embedlib_gather")
  assert "all_reduce" in text
  grad = jax.grad(lambda t, i: lookup(t, i).astype(jnp.float32).sum())
  assert_kernels(cuda_lowering_text(grad, table, ids, mesh=mesh), "mosaic",
                 "embedlib_segment_sum")


def test_lowering_context_rejects_concrete_mesh_with_fix():
  from embedlib.kernels.lowering import lowering_context

  with pytest.raises(TypeError, match="gpu_abstract_mesh"):
    lowering_context(jax.make_mesh((8,), (axes.MODEL,)))


def test_vmapped_lookup_runs_on_cpu_and_lowers_for_cuda():
  """vmap reaches every platform's branch: the lookup runs on CPU and lowers for CUDA.

  (``kernel="auto"``: XLA's gather on CUDA. ``kernel="pallas"`` is not
  vmapped on jax 0.12, whose CPU branch, the Mosaic interpreter, has an
  ordered effect: "IO effect not supported in vmap-of-cond".)
  """
  table = jnp.arange(6.0 * 32).reshape(6, 32)
  ids = jnp.array([[1, 5, -1], [2, 2, 9]])
  looked_up = lambda t, i: jax.vmap(lambda i: kernels.gather(t, i))(i)
  np.testing.assert_array_equal(jax.jit(looked_up)(table, ids), kernels.gather_reference(table, ids))
  text = cuda_lowering_text(looked_up, S(table.shape, table.dtype), S(ids.shape, ids.dtype))
  assert "stablehlo.gather" in text and MOSAIC_GPU_CALL not in text


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_fused_update_lowers_for_cuda_with_tables_past_2_31_elements(rule, monkeypatch):
  """The update kernel, each rule: table and moments updated in place, copied by (row, column).

  A 100M x 64 float32 table (6.4e9 elements): the kernel's table (and
  Adam's moments) stay 2-D ``memref``s, never flattened, so no row offset
  is a flat 32-bit element index; they are aliased to the outputs.
  """
  from embedlib.kernels import mosaic_update

  from .test_large_tables import FEATURES, ROWS, mosaic_modules, tensor_copies_2d

  if not mosaic_update.supports((ROWS, FEATURES), jnp.float32, rule=rule):
    # jax 0.10: no 16-byte copies, the XLA ops update (tests/optim/test_gpu_lowering.py).
    pytest.skip("this jax's Mosaic GPU takes no fused update")
  table, n = S((ROWS, FEATURES), jnp.float32), 96
  vec = lambda dtype=jnp.int32: S((n,), dtype)
  slots = [table] * len(mosaic_update.TABLE_SLOTS[rule])
  per_run = [vec(jnp.float32)] * {"sgd": 0, "adagrad": 1, "adam": 2}[rule]

  def update(table, grads, src, starts, ends, rows, slots, per_run):
    return mosaic_update.fused_update(
        table, grads, src, starts, ends, rows, jnp.float32(0.1), rule=rule,
        table_slots=tuple(slots), per_run=tuple(per_run), eps=1e-8, b1=0.9, b2=0.999,
        features=FEATURES)

  args = (table, S((n, FEATURES), jnp.float32), vec(), vec(), vec(), vec(), slots, per_run)
  (text,) = mosaic_modules(update, args, monkeypatch)
  assert f"memref<{ROWS}x{FEATURES}xf32" in text            # the table, 2-D
  assert not re.search(rf"memref<{ROWS * FEATURES}x", text)  # never flattened
  assert tensor_copies_2d(text) > 0                          # (row, column) copies
  lowered = cuda_lowering_text(update, *args)
  assert MOSAIC_GPU_CALL in lowered and "embedlib_fused_update_mosaic" in lowered
  # In place: the table and each moment are aliased to an output.
  # (One output, SGD's table, is no tuple: no index.)
  aliased = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d*)\]", lowered)
  assert sorted(int(i or 0) for i in aliased) == list(range(1 + len(slots)))
  assert "stablehlo.scatter" not in lowered
