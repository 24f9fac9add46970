"""The fused GPU update (``fused_gpu.py``) in Mosaic GPU's interpret mode (jax >= 0.11), races checked.

Against ``sorted_update``'s XLA ops, which sum each run in the same order
for runs of one or two ids: SGD's and LazyAdam's tables and slots are
theirs bit for bit (the kernel writes the rule's expressions in the rule's
order, and takes Adam's bias corrections from XLA); row-wise AdaGrad sums
a row's squares across lanes in another order, so its accumulator and rows
agree to an ulp or so, as does a global step's Adam table on jax >= 0.12
(where XLA multiplies by the reciprocal of a scalar divisor). Against the
rules' references (``reference``, in float64) with hot rows, invalid ids
and both shard origins of a vocab-sharded table. Inside ``shard_map`` on every strategy (a hidden rank
updates its column slice) against the XLA ops. Widths whose rows are not
whole 16-byte units (1, 3) and other dtypes keep the XLA ops: the tests
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

# A power of two: ``lr * g`` is exact, so XLA's fusing the multiply into the
# add (one rounding fewer) cannot change the bits.
LR = 0.5
RULES = {
    "sgd": optim.SparseSGD(LR),
    "adagrad": optim.RowWiseAdagrad(LR, eps=1e-3),
    "adam": optim.LazyAdam(LR, b1=0.8, b2=0.95),
    "adam-global": optim.LazyAdam(LR, b1=0.8, b2=0.95, eps=1e-3, bias_correction="global"),
}
ROWS = 40
#: Updates before this one (global bias correction).
STEP = 3


@pytest.fixture(autouse=True)
def race_detection(monkeypatch):
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  gpu_callbacks.reset_gpu_interpret_mode_state()
  monkeypatch.setattr(mosaic, "DETECT_RACES", True)
  yield
  races = gpu_callbacks._races  # None when no kernel ran (a path left to XLA)
  assert races is None or not races.races_found


def initial_slots(rule, rows, width):
  """The rule's slots, not at their initial values: moments, counts and accumulators in use."""
  keys = iter(jax.random.split(jax.random.PRNGKey(9), 4))
  made = {"acc": lambda: jax.random.uniform(next(keys), (rows,), minval=0.1, maxval=2.0),
          "m": lambda: jax.random.normal(next(keys), (rows, width)),
          "v": lambda: jax.random.uniform(next(keys), (rows, width), minval=0.01, maxval=1.0),
          "count": lambda: jax.random.randint(next(keys), (rows,), 0, 6)}
  return {name: made[name]() for name in rule.slots()}


def local(rule, ids, grads, *, fused, plan, origin=(0, 0), table=None):
  """``sorted_update.local_update`` on one shard, fused kernel or XLA ops; and the jaxpr."""
  rows = plan.shard_shape[0] if table is None else table.shape[0]
  if table is None:
    table = jax.random.normal(jax.random.PRNGKey(0), (rows, grads.shape[1]))
  slots = initial_slots(rule, rows, table.shape[1])
  f = lambda t, s, i, g: sorted_update.local_update(
      rule, t, s, i, g, jnp.float32(LR), jnp.int32(STEP), plan=plan, origin=origin)
  with fused_cpu.use(False), fused_gpu.use(fused):
    jaxpr = str(jax.make_jaxpr(f)(table, slots, ids, grads))
    out = jax.jit(f)(table, slots, ids, grads)
  return jax.tree.map(np.asarray, out), "embedlib_fused_update_mosaic" in jaxpr


# Every rule on the kernel's widths; two of them on widths it leaves to XLA.
@pytest.mark.parametrize("name,width", [(name, width) for name in RULES for width in (100, 128)]
                         + [("sgd", 3), ("adam", 1)])
def test_equals_xla_ops_where_order_is_the_same(name, width):
  # Rows 3 and 7 twice, rows 9 and 0 once, invalid ids; no row more than twice.
  ids = jnp.array([7, 3, -1, 9, 3, 60, 7, 0], jnp.int32)
  grads = jax.random.normal(jax.random.PRNGKey(1), (8, width))
  plan = plan_embedding(ROWS, width)
  got, ran = local(RULES[name], ids, grads, fused=True, plan=plan)
  want, _ = local(RULES[name], ids, grads, fused=False, plan=plan)
  with fused_gpu.use(True):
    assert ran == fused_gpu.supports(RULES[name], jnp.zeros((ROWS, width)), plan)
  assert ran == (width in (100, 128))
  for leaf, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    if name == "adagrad" or (name == "adam-global" and leaf == 0):
      # The global step's table: the rule divides by its bias corrections,
      # which XLA from jax 0.12 turns into a multiply by the reciprocal of
      # the scalar divisor (the kernel's per-run ones are not scalars).
      np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    else:
      np.testing.assert_array_equal(g, w)


def reference(rule, table, slots, ids, grads, first_row, first_col=0):
  """The rule on each owned row touched by ``ids``, in float64 (numpy).

  ``table`` and table slots may be a column slice from ``first_col``;
  ``grads`` are whole rows.
  """
  table = np.array(table, np.float64)
  slots = {k: np.array(v, np.float64) for k, v in slots.items()}
  ids, grads = np.asarray(ids), np.asarray(grads, np.float64)
  cols = slice(first_col, first_col + table.shape[1])
  for r in set(ids.tolist()):
    row = r - first_row
    if r < 0 or not 0 <= row < table.shape[0]:
      continue
    whole = grads[ids == r].sum(axis=0)
    g = whole[cols]
    if isinstance(rule, optim.RowWiseAdagrad):
      slots["acc"][row] += np.mean(whole * whole)
      table[row] -= LR * g / (np.sqrt(slots["acc"][row]) + rule.eps)
    elif isinstance(rule, optim.LazyAdam):
      m = slots["m"][row] = rule.b1 * slots["m"][row] + (1 - rule.b1) * g
      v = slots["v"][row] = rule.b2 * slots["v"][row] + (1 - rule.b2) * g * g
      if rule.bias_correction == "row":
        slots["count"][row] += 1
      t = slots["count"][row] if rule.bias_correction == "row" else STEP + 1
      table[row] -= LR * (m / (1 - rule.b1**t)) / (np.sqrt(v / (1 - rule.b2**t)) + rule.eps)
    else:
      table[row] -= LR * g
  return table, slots


@pytest.mark.parametrize("name,width", [("sgd", 100), ("adagrad", 128), ("adam", 100),
                                        ("adam-global", 128)])
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
  want_table, want_slots = reference(rule, table, initial_slots(rule, 16, width), ids, grads,
                                     first_row)
  np.testing.assert_allclose(got_table, want_table, rtol=1e-5, atol=1e-5)
  for k, want in want_slots.items():
    np.testing.assert_allclose(got_slots[k], want, rtol=1e-5, atol=1e-6, err_msg=k)
  untouched = np.ones(16, bool)
  untouched[[r - first_row for r in set(ids.tolist()) if 0 <= r - first_row < 16]] = False
  np.testing.assert_array_equal(got_table[untouched], np.asarray(table)[untouched])


def test_other_dtypes_and_rules_keep_the_xla_ops():
  mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
  hidden = plan_embedding(ROWS, 256, mesh=mesh, sharding="hidden", table_axes=("model",))
  vocab = plan_embedding(ROWS, 256, mesh=mesh, sharding="vocab", table_axes=("model",))
  shard = lambda plan, dtype=jnp.float32: jnp.zeros(plan.shard_shape, dtype)
  # By default the XLA ops run (the kernel was measured slower on an H200).
  assert not fused_gpu.supports(RULES["sgd"], shard(vocab), vocab)
  with fused_gpu.use(True):
    assert_kernel_takes_only_its_rules_and_dtypes(hidden, vocab, shard)
  with fused_gpu.use(False):
    assert not fused_gpu.supports(RULES["sgd"], shard(vocab), vocab)


def assert_kernel_takes_only_its_rules_and_dtypes(hidden, vocab, shard):
  assert fused_gpu.supports(RULES["adagrad"], shard(hidden), hidden)
  assert fused_gpu.supports(RULES["sgd"], shard(vocab), vocab)
  assert not fused_gpu.supports(RULES["sgd"], shard(vocab, jnp.bfloat16), vocab)
  bf16_moments = {"m": shard(vocab, jnp.bfloat16), "v": shard(vocab, jnp.bfloat16)}
  assert not fused_gpu.supports(RULES["adam"], shard(vocab), vocab, bf16_moments)
  assert not fused_gpu.supports(optim.rules.RowRule(), shard(vocab), vocab)
  # Rows too wide for the kernel's shared memory.
  wide = plan_embedding(ROWS, 8192)
  assert not fused_gpu.supports(RULES["adam"], jnp.zeros((ROWS, 8192)), wide)


# (mesh shape, names, strategy, table_axes); 128 wide: a hidden rank's 64
# columns are whole 16-byte units.
SHARDED = {
    "replicated": ((2,), ("model",), "replicated", None),
    "vocab": ((2,), ("model",), "vocab", ("model",)),
    "hidden": ((2,), ("model",), "hidden", ("model",)),
    "routed": ((2,), ("batch",), "routed", None),
    "grid": ((2, 2), ("batch", "model"), "grid", ("model",)),   # columns over "batch"
}


# Every rule on a column slice (AdaGrad's whole-row squares, Adam's sliced
# moments); one rule on each of the other strategies.
@pytest.mark.parametrize("strategy,name", [("hidden", "sgd"), ("hidden", "adagrad"),
                                           ("hidden", "adam"), ("vocab", "adam"),
                                           ("routed", "adagrad"), ("replicated", "sgd"),
                                           ("grid", "adagrad")])
def test_every_strategy_inside_shard_map_equals_xla_ops(strategy, name, monkeypatch):
  # Across a shard_map's devices the race detector misreports awaited TMA
  # copies (see tests/kernels/test_mosaic.py); one device checks races above.
  monkeypatch.setattr(mosaic, "DETECT_RACES", False)
  shape, names, sharding, table_axes = SHARDED[strategy]
  mesh = jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])
  plan = plan_embedding(ROWS, 128, mesh=mesh, sharding=sharding, table_axes=table_axes)
  rule = RULES[name]
  # No row more than twice (the XLA ops' sums in the same order), on both halves.
  ids = jnp.array([7, 3, -1, 33, 3, 60, 7, 0, 21, 21, 39, 20, 19, 5, 38, 12], jnp.int32)
  grads = jax.random.normal(jax.random.PRNGKey(4), (ids.shape[0], 128))
  table = jax.random.normal(jax.random.PRNGKey(0), plan.padded_shape)
  slots = optim.init_slots(rule, plan, mesh)
  step = jax.jit(lambda t, s: optim.apply_row_grads(rule, t, s, [(ids, grads)], plan=plan,
                                                    mesh=mesh, step=STEP))
  results = {}
  for fused in (True, False):
    with fused_cpu.use(False), sorted_update.use(True), fused_gpu.use(fused):
      ran = "embedlib_fused_update_mosaic" in str(jax.make_jaxpr(step)(table, slots))
      assert ran == fused
      results[fused] = jax.tree.map(np.asarray, step(table, slots))
  for g, w in zip(jax.tree.leaves(results[True]), jax.tree.leaves(results[False])):
    if name == "adagrad":
      np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    else:
      np.testing.assert_array_equal(g, w)
  assert (results[True][0] != np.asarray(table)).any()
