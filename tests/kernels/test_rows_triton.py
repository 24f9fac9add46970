"""The many-rows-in-flight Triton kernels in Pallas's interpreter against the pure-jnp references.

Every kernel (``gather_rows``, ``bag_rows``, ``quant/bag_rows``,
``segment_rows``, ``update_rows``), every float dtype it reads (float32,
bfloat16), the quantized int8 / int4 rows, every combiner with and without
weights, bags of 1 to 64 ids, widths that are (128) and are not (1, 100:
three column chunks) a power of two, invalid ids, ragged last blocks, and
variants small enough that runs are cut into pieces and summed by the
second kernel. Gradients through `rows_ad` against the references'.
Tolerances: float32 sums in another order, 1e-5 of the largest entry;
bfloat16 rows (summed in float32 from the same bf16 inputs as the
reference), the same, since both read the same rounded rows; a bf16 *output*
is rounded once more, 1e-2.

CI runs each value of each axis at least once (every pair of values where a
grid has three axes, `tests.covering`); ``-m slow`` runs the rest of each
product.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embedlib import invalid_ids
from embedlib.kernels import backward, reference, rows_ad, segment_rows, update_rows
from embedlib.kernels.bag_rows import bag_rows
from embedlib.kernels.gather_rows import gather_rows
from embedlib.kernels.rows import BagVariant, GatherVariant, SegmentVariant
from embedlib.quant import bag_rows as quant_rows
from embedlib.quant import format as fmt
from tests import covering

# Small tiles, so that a handful of ids fill several programs and ragged ends.
GATHER = GatherVariant(rows=8, warps=1)
BAG = BagVariant(bags=4, unroll=3, warps=1)
# Pieces of 2 positions: any id seen 3 times or more is a long run.
SEGMENT = SegmentVariant(piece=2, runs=4, unroll=2, warps=1)
ROWS = 37
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}



def close(got, want, rtol):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-30)
  np.testing.assert_array_less(np.max(np.abs(got - want), initial=0.0) / scale, rtol)


def table_of(width, dtype, seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (ROWS, width)).astype(dtype)


def ids_of(shape, seed=1):
  """Ids in ``[-3, ROWS + 3)``: a few invalid on each side, repeats."""
  return jax.random.randint(jax.random.PRNGKey(seed), shape, -3, ROWS + 3)


# CI: widths 1 / f32, 100 / bf16, 128 / f32; -m slow: all 6.
@pytest.mark.parametrize("width,dtype", covering.each_value_once([1, 100, 128], list(DTYPES)))
def test_gather_equals_reference_exactly(width, dtype):
  table, ids = table_of(width, DTYPES[dtype]), ids_of((5, 7))
  got = gather_rows(table, ids, variant=GATHER, interpret=True)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(reference.gather_reference(table, ids), np.float32))


# Every pair of values in CI (6 cases); -m slow: all 12.
@pytest.mark.parametrize(
    "dtype,combiner,weighted",
    covering.params(list(DTYPES), ["sum", "mean", "sqrtn"], ["plain", "weighted"]),
)
def test_bag_equals_reference_every_combiner(dtype, combiner, weighted):
  dtype = DTYPES[dtype]
  table, ids = table_of(100, dtype), ids_of((9, 5))
  weights = (jax.random.uniform(jax.random.PRNGKey(2), ids.shape, minval=0.1)
             if weighted == "weighted" else None)
  got = bag_rows(table, ids, weights, combiner=combiner, variant=BAG, interpret=True)
  want = reference.bag_reference(table.astype(jnp.float32), ids, weights, combiner=combiner)
  close(got, want, 1e-5 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("bag", [1, 16, 64])
def test_bag_sizes_one_to_64(bag):
  table, ids = table_of(128, jnp.float32), ids_of((6, bag))
  # The last: one bag a program, 16 slots a step (the default for bags of 64).
  for variant in (BAG, BagVariant(bags=2, unroll=8, warps=1), BagVariant(1, 16, 1)):
    got = bag_rows(table, ids, combiner="mean", variant=variant, interpret=True)
    close(got, reference.bag_reference(table, ids, combiner="mean"), 1e-5)


# CI: each bit width, width and block count once; -m slow adds int4 rows of 128.
@pytest.mark.parametrize("bits,width,blocks", [
    (8, 100, 1), (8, 128, 4), pytest.param(4, 128, 1, marks=pytest.mark.slow), (4, 12, 2)])
def test_quantized_bags_and_gather_equal_the_dequantized_reference(bits, width, blocks):
  table = fmt.quantize_table(np.asarray(table_of(width, jnp.float32)), bits=bits, blocks=blocks)
  assert quant_rows.supports(table)
  dense = fmt.dequantize(table)
  ids = ids_of((7, 6))
  weights = jax.random.uniform(jax.random.PRNGKey(3), ids.shape, minval=0.1)
  for combiner, w in (("sum", None), ("mean", weights), ("sqrtn", None)):
    got = quant_rows.bag_rows(table, ids, w, combiner=combiner, variant=BAG, interpret=True)
    close(got, reference.bag_reference(dense, ids, w, combiner=combiner), 1e-5)
  got = quant_rows.gather_rows(table, ids, variant=GATHER, interpret=True)
  close(got, reference.gather_reference(dense, ids), 1e-6)


def test_quantized_formats_the_rows_kernels_leave_to_the_others():
  t = np.ones((4, 6), np.float32)
  assert not quant_rows.supports(fmt.quantize_table(t, bits="fp8"))
  assert not quant_rows.supports(fmt.quantize_table(t, bits="bf16"))
  assert not quant_rows.supports(fmt.quantize_table(np.ones((4, 5), np.float32), bits=4))


def zipf_ids(n, seed=4):
  """A hot id (a third of them), a few warm ones, invalid ids: long runs and short ones."""
  rng = np.random.default_rng(seed)
  ids = np.where(rng.random(n) < 0.35, 5, rng.integers(-2, ROWS + 2, n))
  return jnp.asarray(ids, jnp.int32)


# CI: plain / f32 and coef / bf16; -m slow: all 4.
@pytest.mark.parametrize("scaled,dtype", covering.each_value_once(["plain", "coef"], list(DTYPES)))
def test_segment_sums_equal_the_reference_with_long_runs(scaled, dtype):
  n = 40
  ids = zipf_ids(n)
  grads = jax.random.normal(jax.random.PRNGKey(5), (n, 100)).astype(DTYPES[dtype])
  coef = jax.random.uniform(jax.random.PRNGKey(6), (n,)) if scaled == "coef" else None
  src = jnp.arange(n, dtype=jnp.int32)
  got = segment_rows.segment_sum_rows(grads, src, ids, ROWS, coef=coef, dtype=jnp.float32,
                                      variant=SEGMENT, interpret=True)
  valid = invalid_ids.valid_mask(ids, ROWS)
  contrib = grads.astype(jnp.float32) * (1.0 if coef is None else coef[:, None])
  want = jax.ops.segment_sum(jnp.where(valid[:, None], contrib, 0), jnp.where(valid, ids, 0),
                             ROWS)
  close(got, want, 1e-5)


def test_row_sums_in_id_order_and_zero_past_the_distinct_ids():
  n = 30
  ids = zipf_ids(n, seed=7)
  grads = jax.random.normal(jax.random.PRNGKey(8), (n, 3))
  got = np.asarray(segment_rows.row_sums(grads, ids, ROWS, variant=SEGMENT, interpret=True))
  ids_np, g = np.asarray(ids), np.asarray(grads)
  distinct = np.unique(ids_np[(ids_np >= 0) & (ids_np < ROWS)])
  want = np.stack([g[ids_np == r].sum(axis=0) for r in distinct])
  close(got[:len(distinct)], want, 1e-5)
  assert not got[len(distinct):].any()


def test_pieces_cover_each_run_once():
  order, starts, ends, _, count = backward.segments(zipf_ids(50, seed=9), ROWS)
  plan = segment_rows.pieces(starts, ends, 50, 3)
  start, end, run = map(np.asarray, (plan.start, plan.end, plan.run))
  covered = np.zeros(50, int)
  for s, e, u in zip(start, end, run):
    assert e - s <= 3 and (e == s or starts[u] <= s < e <= ends[u])
    covered[s:e] += 1
  assert (covered[:int(ends[int(count) - 1])] == 1).all()
  long_runs = [u for u in np.asarray(plan.long_runs) if u >= 0]
  assert long_runs == [u for u in range(int(count)) if ends[u] - starts[u] > 3]


LR = 0.5
RULES = {"sgd": ({}, ()), "adagrad": ({"eps": 1e-3}, ("acc",)),
         "adam": ({"eps": 1e-3, "b1": 0.8, "b2": 0.95}, ("c1", "c2"))}


@pytest.mark.parametrize("rule", list(RULES))
def test_fused_update_equals_the_rule_in_float64_with_long_runs(rule):
  hyper, per_run_names = RULES[rule]
  n, width = 40, 100
  ids = zipf_ids(n, seed=11)
  key = jnp.where(invalid_ids.valid_mask(ids, ROWS), ids, ROWS)
  key, src = jax.lax.sort((key, jnp.arange(n, dtype=jnp.int32)), num_keys=1, is_stable=True)
  from embedlib.optim import fused_gpu   # the runs the optimizer hands the kernel
  starts, ends, rows = fused_gpu._runs(key, ROWS)
  grads = jax.random.normal(jax.random.PRNGKey(12), (n, width))
  table = table_of(width, jnp.float32, seed=13)
  keys = iter(jax.random.split(jax.random.PRNGKey(14), 4))
  slots = tuple(jax.random.normal(next(keys), (ROWS, width)) ** (i + 1)
                for i in range(len(update_rows.TABLE_SLOTS[rule])))
  per_run = tuple(jax.random.uniform(next(keys), (n,), minval=0.1, maxval=0.9)
                  for _ in per_run_names)
  out, out_slots, new_acc = update_rows.fused_update(
      table, grads, src, starts, ends, rows, LR, rule=rule, table_slots=slots, per_run=per_run,
      features=width, variant=SEGMENT, interpret=True, **hyper)
  want = np.array(table, np.float64)
  want_slots = [np.array(s, np.float64) for s in slots]
  g64, rows_np = np.asarray(grads, np.float64), np.asarray(rows)
  for u in range(n):
    if int(starts[u]) == int(ends[u]):
      continue
    r = rows_np[u]
    g = g64[np.asarray(src)[int(starts[u]):int(ends[u])]].sum(axis=0)
    if rule == "sgd":
      want[r] -= LR * g
    elif rule == "adagrad":
      acc = float(per_run[0][u]) + np.mean(g * g)
      np.testing.assert_allclose(float(new_acc[u]), acc, rtol=1e-5)
      want[r] -= LR * g / (np.sqrt(acc) + hyper["eps"])
    else:
      m = want_slots[0][r] = 0.8 * want_slots[0][r] + 0.2 * g
      v = want_slots[1][r] = 0.95 * want_slots[1][r] + 0.05 * g * g
      c1, c2 = float(per_run[0][u]), float(per_run[1][u])
      want[r] -= LR * (m / c1) / (np.sqrt(v / c2) + hyper["eps"])
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  for got, w in zip(out_slots, want_slots):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


# CI: each kernel with XLA on the other side (a forward kernel with the
# segment backward runs in CI in test_bag_gradients_of_table_and_weights);
# -m slow adds both kernels together.
@pytest.mark.parametrize("forward,backward_", [
    pytest.param(GATHER.name, SEGMENT.name, marks=pytest.mark.slow), (None, SEGMENT.name),
    (GATHER.name, None)])
def test_gather_gradient_every_pair_of_forward_and_backward(forward, backward_):
  table, ids = table_of(100, jnp.float32), zipf_ids(24, seed=15).reshape(4, 6)
  cot = jax.random.normal(jax.random.PRNGKey(16), ids.shape + (100,))
  loss = lambda f: lambda t: jnp.sum(f(t) * cot)
  got = jax.grad(loss(lambda t: rows_ad.gather(t, ids, forward, backward_, True)))(table)
  want = jax.grad(loss(lambda t: reference.gather_reference(t, ids)))(table)
  close(got, want, 1e-5)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_bag_gradients_of_table_and_weights(combiner):
  table, ids = table_of(100, jnp.float32), zipf_ids(30, seed=17).reshape(5, 6)
  weights = jax.random.uniform(jax.random.PRNGKey(18), ids.shape, minval=0.1)
  cot = jax.random.normal(jax.random.PRNGKey(19), (5, 100))
  loss = lambda f: lambda t, w: jnp.sum(f(t, w) * cot)
  rows_bag = lambda t, w: rows_ad.bag(t, ids, w, combiner, BAG.name, SEGMENT.name, True)
  ref_bag = lambda t, w: reference.bag_reference(t, ids, w, combiner=combiner)
  got = jax.grad(loss(rows_bag), argnums=(0, 1))(table, weights)
  want = jax.grad(loss(ref_bag), argnums=(0, 1))(table, weights)
  for g, w in zip(got, want):
    close(g, w, 1e-5)
