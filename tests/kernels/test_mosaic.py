"""The Mosaic GPU kernels in Mosaic GPU's interpret mode (jax >= 0.11), races checked.

Every lookup through ``kernel="mosaic"`` (what ``"pallas"`` names on these
jax versions) equals its reference: forward and gradient, widths 1 / 3 /
100 / 128 / 512, float32 and bfloat16, invalid, duplicate and padding ids
and an empty bag. Tables whose rows are not whole 16-byte units run the
XLA ops; the tests check which path ran. Inside ``shard_map`` every
strategy's lookup and gradient equals ``kernel="xla"``'s. On one device
the interpreter checks every shared-memory and global access for races
(``mosaic.DETECT_RACES``) and raises on one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import kernels
from embedlib.kernels import mosaic

pytestmark = pytest.mark.skipif(
    not mosaic.has_interpreter(),
    reason="Mosaic GPU's interpreter needs jax >= 0.11 (CI's Python 3.12 leg); "
    "tests/kernels/test_lowering.py covers the kernels' CUDA lowering here.")

WIDTHS = (1, 3, 100, 128, 512)
DTYPES = (jnp.float32, jnp.bfloat16)
NUM_EMBEDDINGS = 21


@pytest.fixture(autouse=True)
def race_detection(request, monkeypatch):
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  gpu_callbacks.reset_gpu_interpret_mode_state()
  # On one device the detector checks every access. Across the 8 devices of
  # a shard_map (which jax's own interpreter tests never run: they require
  # one device) it reports a TMA copy's completion, awaited on its barrier,
  # as racing with the reads after the wait, although the same kernel is
  # clean on one device; there it stays off.
  monkeypatch.setattr(mosaic, "DETECT_RACES", "shard_map" not in request.node.name)
  yield
  races = gpu_callbacks._races  # None when no kernel ran (a table left to XLA)
  assert races is None or not races.races_found


def table_of(width, dtype):
  return jax.random.normal(jax.random.PRNGKey(width), (NUM_EMBEDDINGS, width)).astype(dtype)


def ids_of(shape, seed=0):
  """Ids with invalid ones (negative, past the table) and many repeats."""
  return jax.random.randint(jax.random.PRNGKey(seed), shape, -3, NUM_EMBEDDINGS // 3 + 3) % (
      NUM_EMBEDDINGS + 4) - 2


def tolerance(dtype):
  # f32: the reference adds the same terms in the same order; XLA may fuse a
  # multiply and an add (one rounding fewer), an ulp or two. bf16: the
  # kernels sum in float32 and round once; compared with the exact (float32)
  # answer, one bf16 rounding (2**-8 relative) plus the float32 sum's.
  return dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_gradient_equal_reference(width, dtype):
  table, ids = table_of(width, dtype), ids_of((9, 2))
  cot = jax.random.normal(jax.random.PRNGKey(3), ids.shape + (width,))

  def run(lookup):
    out, vjp = jax.vjp(lambda t: lookup(t, ids), table)
    return out, vjp(cot.astype(dtype))[0]

  got = jax.jit(lambda t: run(lambda t, i: kernels.gather(t, i, kernel="mosaic")))(table)
  want = run(kernels.gather_reference)
  exact = jax.vjp(lambda t: kernels.gather_reference(t, ids), table.astype(jnp.float32))[1](
      cot.astype(dtype).astype(jnp.float32))[0]
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
  np.testing.assert_allclose(np.asarray(got[1], np.float32), exact, **tolerance(dtype))
  ran = str(jax.make_jaxpr(lambda t: kernels.gather(t, ids, kernel="mosaic"))(table))
  assert ("embedlib_gather_mosaic" in ran) == mosaic.supports(table.shape, dtype)


# One combiner / weighting per width keeps the interpreted runs few; over the
# widths every combiner runs with and without weights.
BAGS = [(1, "sum", False), (3, "mean", True), (100, "sqrtn", True), (128, "mean", False),
        (512, "sqrtn", False), (100, "sum", True)]


@pytest.mark.parametrize("width,combiner,weighted", BAGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bag_and_gradients_equal_reference(width, combiner, weighted, dtype):
  table = table_of(width, dtype)
  ids = ids_of((5, 4), seed=width).at[2].set(-1)      # bag 2 is empty
  weights = jax.random.uniform(jax.random.PRNGKey(4), ids.shape, minval=0.5, maxval=2.0)
  weights = weights if weighted else None
  cot = jax.random.normal(jax.random.PRNGKey(5), (5, width))

  def run(lookup):
    out, vjp = jax.vjp(lambda t, w: lookup(t, ids, w), table, weights)
    return (out, *vjp(cot.astype(dtype)))

  mosaic_bag = lambda t, i, w: kernels.bag(t, i, w, combiner=combiner, kernel="mosaic")
  got = jax.jit(lambda t, w: run(mosaic_bag))(table, weights)
  # The exact answer: the reference in float32 on the same (rounded) values.
  exact = lambda t, i, w: kernels.bag_reference(t.astype(jnp.float32), i, w, combiner=combiner)
  want = run(exact) if dtype == jnp.float32 else jax.vjp(
      lambda t, w: exact(t, ids, w), table.astype(jnp.float32), weights)[1](
          cot.astype(dtype).astype(jnp.float32))
  if dtype != jnp.float32:
    want = (exact(table, ids, weights), *want)
  for g, w in zip(got, want):
    if w is not None:
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                 **tolerance(dtype))
  assert not np.asarray(got[0], np.float32)[2].any()  # the empty bag pools to zeros


# One case per kind of shard_map body the kernels run in: rows split (vocab),
# columns split over both axes (hidden), ids sent to owners (routed). The
# interpreter runs each kernel once per device, so each case is costly; the
# contract (tests/embed/test_contract.py) covers every layout with the XLA
# and Pallas-interpret kernels.
STRATEGIES = [("vocab", None), ("hidden", ("data", "model")), ("routed", None)]


@pytest.mark.parametrize("strategy,table_axes", STRATEGIES)
def test_every_strategy_inside_shard_map_equals_xla(strategy, table_axes):
  mesh = jax.make_mesh((2, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  ids = ids_of((16, 3), seed=7) % 40 - 2
  make = lambda kernel: embedlib.ShardedEmbed(
      37, 64, mesh=mesh, sharding=strategy, table_axes=table_axes, kernel=kernel,
      rngs=nnx.Rngs(0))

  def loss(emb):
    return jnp.sum(emb(ids) ** 2) + jnp.sum(emb.bag(ids, combiner="mean") ** 2)

  results = {}
  for kernel in ("pallas", "xla"):
    emb = make(kernel)
    results[kernel] = nnx.jit(lambda e: (emb(ids), nnx.grad(loss)(e)))(emb)
  np.testing.assert_array_equal(results["pallas"][0], results["xla"][0])
  got, want = (jax.tree.leaves(results[k][1]) for k in ("pallas", "xla"))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_pallas_and_auto_use_mosaic_without_deprecation_warnings():
  """jax >= 0.11 deprecates the Triton backend: kernel="pallas" and "auto" never touch it.

  ("auto" on a GPU runs XLA's ops, measured faster: `gpu_choice`.)
  """
  import warnings

  from embedlib.kernels import lowering

  table, ids = table_of(128, jnp.float32), ids_of((4, 3))
  S = jax.ShapeDtypeStruct
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    got = jax.jit(lambda t: kernels.bag(t, ids, kernel="pallas"))(table)
    for kernel, call in (("pallas", lowering.MOSAIC_GPU_CALL), ("auto", "stablehlo.gather")):
      text = lowering.cuda_lowering_text(
          lambda t, i: kernels.bag(t, i, kernel=kernel), S(table.shape, table.dtype),
          S(ids.shape, ids.dtype))
      assert call in text and lowering.TRITON_CALL not in text
  np.testing.assert_allclose(got, kernels.bag_reference(table, ids), rtol=1e-6, atol=1e-6)


def test_rows_split_by_columns_equal_reference(monkeypatch):
  """Rows too wide for one block's shared memory: each program takes a third of the columns.

  The limit is lowered so that a 384-wide float32 row splits into three
  programs' 128 columns in the gather, the bag and the backward (what a
  2048-wide row does under an H100's 227 KiB); the results stay exact.
  """
  monkeypatch.setattr(mosaic, "SMEM_LIMIT", 21_000)
  split = mosaic.program_columns
  taken = []
  monkeypatch.setattr(mosaic, "program_columns",
                      lambda *args: taken.append(split(*args)) or taken[-1])
  width = 384
  table, ids = table_of(width, jnp.float32), ids_of((9, 2))
  bag_ids = ids_of((5, 4), seed=1).at[2].set(-1)
  weights = jax.random.uniform(jax.random.PRNGKey(4), bag_ids.shape, minval=0.5, maxval=2.0)

  def run(gather, bag):
    def loss(t):
      rows, pooled = gather(t, ids), bag(t, bag_ids, weights)
      return jnp.sum(rows * jnp.arange(width)) + jnp.sum(pooled ** 2), (rows, pooled)
    return jax.value_and_grad(loss, has_aux=True)(table)

  got = jax.jit(lambda: run(lambda t, i: kernels.gather(t, i, kernel="mosaic"),
                            lambda t, i, w: kernels.bag(t, i, w, combiner="mean",
                                                        kernel="mosaic")))()
  assert taken and set(taken) == {128} and len(taken) >= 3   # gather, bag, backward
  want = run(kernels.gather_reference,
             lambda t, i, w: kernels.bag_reference(t, i, w, combiner="mean"))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, **tolerance(jnp.float32))
