"""The fused GPU update (``fused_gpu.py``) in Mosaic GPU's interpret mode (jax >= 0.11), races checked.

Against ``sorted_update``'s XLA ops, which sum each run in the same order
for runs of one or two ids: SGD's tables are theirs bit for bit;
row-wise AdaGrad sums a row's squares across lanes in another order, so
its accumulator and rows agree to an ulp or so. Against the rules'
references (``reference.py``) with hot rows, invalid ids and both shard
origins of a vocab-sharded table. Widths whose rows are not whole 16-byte
units (1, 3), hidden sharding and LazyAdam keep the XLA ops: the tests
check which path ran.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embedlib import optim
from embedlib.kernels import mosaic
from embedlib.optim import fused_cpu, fused_gpu, sorted_update
from embedlib.plan import plan_embedding

pytestmark = pytest.mark.skipif(
    not mosaic.has_interpreter(),
    reason="Mosaic GPU's interpreter needs jax >= 0.11 (CI's Python 3.12 leg); "
    "tests/optim/test_gpu_lowering.py covers the kernel's CUDA lowering here.")

RULES = {
    "sgd": optim.SparseSGD(0.3),
    "adagrad": optim.RowWiseAdagrad(0.3, eps=1e-3),
    "adam": optim.LazyAdam(0.3, b1=0.8, b2=0.95),
}
WIDTHS = (1, 3, 100, 128)
ROWS = 40
# A power of two: ``lr * g`` is exact, so XLA's fusing the multiply into the
# add (one rounding fewer) cannot change the bits.
LR = 0.5


@pytest.fixture(autouse=True)
def race_detection(monkeypatch):
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  gpu_callbacks.reset_gpu_interpret_mode_state()
  monkeypatch.setattr(mosaic, "DETECT_RACES", True)
  yield
  races = gpu_callbacks._races  # None when no kernel ran (a path left to XLA)
  assert races is None or not races.races_found


def local(rule, ids, grads, *, fused, plan, origin=(0, 0), table=None):
  """``sorted_update.local_update`` on one shard, fused kernel or XLA ops; and the jaxpr."""
  rows = plan.shard_shape[0] if table is None else table.shape[0]
  if table is None:
    table = jax.random.normal(jax.random.PRNGKey(0), (rows, grads.shape[1]))
  slots = {name: jnp.full((rows,) if s.kind == "row" else table.shape, s.init, s.dtype)
           for name, s in rule.slots().items()}
  f = lambda t, s, i, g: sorted_update.local_update(
      rule, t, s, i, g, jnp.float32(LR), jnp.int32(0), plan=plan, origin=origin)
  with fused_cpu.use(False), fused_gpu.use(fused):
    jaxpr = str(jax.make_jaxpr(f)(table, slots, ids, grads))
    out = jax.jit(f)(table, slots, ids, grads)
  return jax.tree.map(np.asarray, out), "embedlib_fused_update_mosaic" in jaxpr


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", sorted(RULES))
def test_equals_xla_ops_where_order_is_the_same(name, width):
  # Rows 3 and 7 twice, rows 9 and 0 once, invalid ids; no row more than twice.
  ids = jnp.array([7, 3, -1, 9, 3, 60, 7, 0], jnp.int32)
  grads = jax.random.normal(jax.random.PRNGKey(1), (8, width))
  plan = plan_embedding(ROWS, width)
  got, ran = local(RULES[name], ids, grads, fused=True, plan=plan)
  want, _ = local(RULES[name], ids, grads, fused=False, plan=plan)
  assert ran == (name != "adam" and fused_gpu.supports(RULES[name], jnp.zeros((ROWS, width)), plan))
  assert ran == (name != "adam" and width in (100, 128))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if name == "sgd":
      np.testing.assert_array_equal(g, w)
    else:
      np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)


def reference(rule, table, acc, ids, grads, first_row):
  """The rule on each owned row touched by ``ids``, in float64 (numpy)."""
  table, acc = np.array(table, np.float64), np.array(acc, np.float64)
  ids, grads = np.asarray(ids), np.asarray(grads, np.float64)
  for r in set(ids.tolist()):
    row = r - first_row
    if r < 0 or not 0 <= row < table.shape[0]:
      continue
    g = grads[ids == r].sum(axis=0)
    if isinstance(rule, optim.RowWiseAdagrad):
      acc[row] += np.mean(g * g)
      table[row] -= LR * g / (np.sqrt(acc[row]) + rule.eps)
    else:
      table[row] -= LR * g
  return table, acc


@pytest.mark.parametrize("width", (100, 128))
@pytest.mark.parametrize("name", ("sgd", "adagrad"))
@pytest.mark.parametrize("first_row", (0, 16))      # a vocab shard's origin: rows 16 to 31
def test_hot_rows_and_shard_origins_equal_reference(name, width, first_row):
  rule = RULES[name]
  # Row 21 eleven times (two groups of copies), ids below, inside and past the shard.
  ids = jnp.concatenate([jnp.full((11,), 21), jnp.array([-1, 3, 16, 31, 32, 39, 17, 16, 50]),
                         jnp.arange(24) % 5 + 18]).astype(jnp.int32)
  grads = jax.random.normal(jax.random.PRNGKey(2), (ids.shape[0], width))
  table = jax.random.normal(jax.random.PRNGKey(0), (16, width))
  plan = plan_embedding(ROWS, width)
  (got_table, got_slots), ran = local(rule, ids, grads, fused=True, plan=plan,
                                      origin=(first_row, 0), table=table)
  assert ran
  want_table, want_acc = reference(rule, table, np.zeros(16), ids, grads, first_row)
  np.testing.assert_allclose(got_table, want_table, rtol=1e-5, atol=1e-5)
  if name == "adagrad":
    np.testing.assert_allclose(got_slots["acc"], want_acc, rtol=1e-5)
  untouched = np.ones(16, bool)
  untouched[[r - first_row for r in set(ids.tolist()) if 0 <= r - first_row < 16]] = False
  np.testing.assert_array_equal(got_table[untouched], np.asarray(table)[untouched])


def test_hidden_sharding_and_other_dtypes_keep_the_xla_ops():
  mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
  hidden = plan_embedding(ROWS, 256, mesh=mesh, sharding="hidden", table_axes=("model",))
  vocab = plan_embedding(ROWS, 256, mesh=mesh, sharding="vocab", table_axes=("model",))
  shard = lambda plan, dtype=jnp.float32: jnp.zeros(plan.shard_shape, dtype)
  assert not fused_gpu.supports(RULES["sgd"], shard(hidden), hidden)
  assert fused_gpu.supports(RULES["sgd"], shard(vocab), vocab)
  assert not fused_gpu.supports(RULES["sgd"], shard(vocab, jnp.bfloat16), vocab)
  assert not fused_gpu.supports(RULES["adam"], shard(vocab), vocab)
  with fused_gpu.use(False):
    assert not fused_gpu.supports(RULES["sgd"], shard(vocab), vocab)
