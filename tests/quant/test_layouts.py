"""Quantized lookups in every layout and kernel: the float twin's results, bit for bit.

The twin (`tests.quant.twin`) is the float module holding the dequantized
tables in the same layout; the float contract tests tie it to the
single-device reference. Here each case also checks the gathers against
that reference directly, and the rows against the float table within the
format's stated bound. Bags are exact where the float bag runs the same
kernel family (on jax >= 0.12 only unweighted sums: XLA multiplies the
other bags' dequantized terms in another order); where it is Mosaic
GPU's (jax >= 0.11's ``pallas`` on CPU) it sums the same terms in another
order: f32 ulps, 1e-6. Layout x kernel x
format x mesh is covered pairwise (`tests.covering`); ``-m slow`` runs the
rest of the product.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import kernels
from embedlib.quant import format as fmt
from embedlib.quant import lookup
from tests.covering import params
from tests.embed.contract import make_mesh, reference_lookup
from tests.quant.twin import quantized_and_twin

MESHES = {
    "8-tokens": ((8,), ("batch",), None, None, None),
    "2x4-tp": ((2, 4), ("data", "model"), None, None, None),
    "4x2-grid": ((4, 2), ("data", "model"), ("data",), ("model",), None),
}
LAYOUTS = ["replicated", "vocab", "hidden", "routed", "grid"]
KERNELS = ["xla", "pallas", "cpu"]
SIZES = {"replicated": (7, 5), "vocab": (99, 10), "hidden": (13, 7), "routed": (99, 6),
         "grid": (99, 10)}


def _ids(num_embeddings, shape, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(-2, num_embeddings + 3, shape).astype(np.int32)
  ids.flat[0] = num_embeddings  # invalid ids of both signs, always
  ids.flat[-1] = -1
  return jnp.asarray(ids)


@nnx.jit(static_argnums=4)
def _results(q, twin, emb, ids, combiner, weights):
  """Every lookup a case compares, as one program (one compile per case)."""
  return (q(ids), twin(ids), emb(ids), q.bag(ids, weights, combiner=combiner),
          twin.bag(ids, weights, combiner=combiner))


@pytest.mark.parametrize("layout, kernel, bits, mesh_name",
                         params(LAYOUTS, KERNELS, fmt.FORMATS, list(MESHES)))
def test_layout_kernel_format(layout, kernel, bits, mesh_name):
  shape, names, table_axes, column_axes, data_axes = MESHES[mesh_name]
  if layout == "grid" and column_axes is None:
    # A grid needs two axes: the rows over the tokens' axis, or the tensor axis.
    shape, names = ((4, 2), ("batch", "col")) if len(shape) < 2 else (shape, names)
    table_axes, column_axes = (names[-1],), (names[0],)
  kw = dict(table_axes=table_axes, column_axes=column_axes) if layout == "grid" else {}
  mesh = make_mesh(shape, names)
  n, f = SIZES[layout]
  emb = embedlib.ShardedEmbed(n, f, mesh=mesh, sharding=layout, kernel=kernel,
                              rngs=nnx.Rngs(0), **kw)
  q, twin = quantized_and_twin(emb, bits)
  assert q.plan.strategy == layout
  ids = _ids(n, (11, 3))
  # The combiners and weights rotate over the cases.
  case = LAYOUTS.index(layout) + KERNELS.index(kernel) + fmt.FORMATS.index(bits)
  combiner = ("sum", "mean", "sqrtn")[case % 3]
  weights = None if case % 2 else jnp.asarray(
      np.random.default_rng(1).uniform(0.5, 2, ids.shape), jnp.float32)
  out, twin_out, float_out, bags, twin_bags = _results(q, twin, emb, ids, combiner, weights)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(twin_out))
  # XLA from jax 0.12 reorders the multiplies of a bag's dequantized terms
  # (the code's scale, the weight, the mean's or sqrtn's factor): f32 ulps.
  reassociated = jax.__version_info__ >= (0, 12) and (weights is not None or combiner != "sum")
  if lookup.plan(kernel)["cpu"] == kernels.plan(kernel)["cpu"] and not reassociated:
    np.testing.assert_array_equal(np.asarray(bags), np.asarray(twin_bags))
  else:  # jax >= 0.11: the float twin's bag is Mosaic GPU's, which sums in another order
    np.testing.assert_allclose(np.asarray(bags), np.asarray(twin_bags), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(out),
                                np.asarray(reference_lookup(q.dequantized(), ids)))
  # Within the format's bound of the float table, where valid (zeros elsewhere).
  physical = np.asarray(jax.device_get(emb.physical_table()))
  bound = fmt.error_bound(physical, jax.device_get(q.physical_table()))[:n, :f]
  valid = np.asarray((ids >= 0) & (ids < n))
  err = np.abs(np.asarray(out) - np.asarray(float_out))
  assert (err <= bound[np.where(valid, ids, 0)]).all()
  assert not np.asarray(out)[~valid].any()


def test_jit_and_bf16_scales():
  mesh = make_mesh((8,), ("batch",))
  emb = embedlib.ShardedEmbed(50, 8, mesh=mesh, sharding="vocab", rngs=nnx.Rngs(1))
  q, twin = quantized_and_twin(emb, 4, jnp.bfloat16)
  assert q.physical_table().scale_bias.dtype == jnp.bfloat16
  ids = _ids(50, (16, 4))
  got = nnx.jit(lambda m, i: m.bag(i, combiner="mean"))(q, ids)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(twin.bag(ids, combiner="mean")))


def test_invalid_ids_error_rule():
  emb = embedlib.ShardedEmbed(10, 4, invalid_ids="error", rngs=nnx.Rngs(0))
  q = embedlib.quantize(emb, 8)
  with pytest.raises(IndexError, match="10"):  # the float module's error, as is
    q(jnp.array([3, 10]))
  assert q(jnp.array([3, 9])).shape == (2, 4)


def test_training_is_an_error():
  emb = embedlib.ShardedEmbed(10, 4, rngs=nnx.Rngs(0))
  q = embedlib.quantize(emb, 8)
  assert not nnx.state(q, nnx.Param)  # nothing for an optimizer
  ids = jnp.array([1, 2])
  table = q.physical_table()
  rows = lambda sb: lookup.gather(dataclasses.replace(table, scale_bias=sb), ids, kernel="xla")
  with pytest.raises(ValueError, match="train the float module"):
    jax.grad(lambda sb: jnp.sum(rows(sb)))(table.scale_bias)
  # The sparse optimizers' tape: the training step of a model.
  with pytest.raises(ValueError, match="train the float module"):
    embedlib.optim.value_and_grad(lambda m: jnp.sum(m(ids)))(q)
  with pytest.raises(ValueError, match="already quantized"):
    embedlib.quantize(q)


def test_collection_with_stacks():
  from tests.collection.test_placement import FEATURES, TABLES, BATCH, make_inputs
  mesh = jax.make_mesh((8,), ("batch",))
  coll = embedlib.EmbeddingCollection(TABLES, FEATURES, mesh=mesh, table_batched=True,
                                      batch_size=BATCH, devices_per_host=4, rngs=nnx.Rngs(0))
  q, twin = quantized_and_twin(coll, 8)
  assert sum(isinstance(m, embedlib.QuantizedEmbed) for _, m in nnx.iter_graph(q)) >= 3
  assert q.stacks  # tables stacked by placement
  inputs, weights = make_inputs()
  got, want = q(inputs, weights), twin(inputs, weights)
  for name in want:
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def test_dedup_on_a_routed_table():
  from embedlib.strategies import Request
  mesh = make_mesh((8,), ("batch",))
  emb = embedlib.ShardedEmbed(99, 6, mesh=mesh, sharding="routed", rngs=nnx.Rngs(0))
  q, twin = quantized_and_twin(emb, 4)
  requests = (Request(_ids(99, (16, 3)), None, "mean"),)
  (got,), (want,) = (m.lookup_requests(requests, num_unique=8) for m in (q, twin))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_shared_tables_stay_shared():
  emb = embedlib.ShardedEmbed(5, 2, rngs=nnx.Rngs(0))

  class Holder(nnx.Module):
    def __init__(self):
      self.a, self.b = emb, emb
      self.d, self.l = nnx.Dict({"x": emb}), nnx.List([emb])

  m = embedlib.quantize(Holder(), "fp8")
  assert isinstance(m.a, embedlib.QuantizedEmbed) and m.a is m.b is m.d["x"] is m.l[0]
  with pytest.raises(ValueError, match="holds no ShardedEmbed"):
    embedlib.quantize(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
