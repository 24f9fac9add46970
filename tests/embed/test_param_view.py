"""``emb.embedding`` as ``nnx.Embed`` code reads and writes it: the logical table.

Tables whose sizes don't divide the shard group (99 rows, or 10 columns,
over 4 devices) are stored padded; every way user code reaches the
parameter (``[...]``, ``.value``, ``.shape``, ``set_value``, ``nnx.state``,
gradients, ``nnx.Optimizer``, ``nnx.bridge.to_linen``) must see the
``[num_embeddings, features]`` table, while lookups, optax and the sparse
optimizers keep working on the stored (physical) array. References are
``jnp.take`` and ``nnx.Embed`` in float32; an AdamW step of a sharded table
sums in another order than the single-device one: ``1e-5``.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import embedlib
from embedlib import optim

from .contract import make_mesh

# (sharding, num_embeddings, features): padded to (100, 8) and (10, 12).
LAYOUTS = {"vocab": ("vocab", 99, 8), "hidden": ("hidden", 10, 10)}
AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
IDS = np.array([0, 5, 9, 3, 7, 1, 2, 9], np.int32)


def _mesh(axis_type):
  return make_mesh((2, 4), ("data", "model"), axis_types=(AXIS_TYPES[axis_type],) * 2)


def _table(n, f, scale=1.0):
  return scale * jnp.arange(n * f, dtype=jnp.float32).reshape(n, f) / (n * f)


@pytest.fixture(scope="module")
def built():
  """``(axis_type, layout) -> ShardedEmbed``, built once per module."""
  cache = {}

  def get(axis_type, layout):
    if (axis_type, layout) not in cache:
      sharding, n, f = LAYOUTS[layout]
      cache[axis_type, layout] = embedlib.ShardedEmbed(
          n, f, mesh=_mesh(axis_type), sharding=sharding, table_axes=("model",),
          rngs=nnx.Rngs(0))
    return cache[axis_type, layout]

  return get


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reads_are_logical(built, layout):
  emb = built("explicit", layout)
  _, n, f = LAYOUTS[layout]
  assert emb.plan.padded_shape != (n, f)  # the case this file is about
  logical = np.asarray(emb.logical_table())
  assert emb.embedding.shape == (n, f)
  np.testing.assert_array_equal(emb.embedding[...], logical)
  np.testing.assert_array_equal(emb.embedding.get_value(), logical)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # flax deprecates .value
    np.testing.assert_array_equal(emb.embedding.value, logical)
  leaf = nnx.state(emb)["embedding"]
  assert leaf.shape == (n, f)
  np.testing.assert_array_equal(leaf[...], logical)
  # Stored padded, as the plan says.
  assert emb.embedding.get_raw_value().shape == emb.plan.padded_shape


@pytest.mark.parametrize("layout", LAYOUTS)
def test_indexed_reads_nnx_embed_code_writes_are_logical(built, layout):
  """``embedding[ids]`` (flax's older Gemma ``Embedder.encode``) and 2-D slices, cut.

  On Auto axes: on Explicit ones jax itself refuses to gather from a split
  array without an ``out_sharding``, for ``nnx.Embed`` too.
  """
  emb = built("auto", layout)
  _, n, f = LAYOUTS[layout]
  logical = np.asarray(emb.logical_table())
  ids = jnp.asarray(IDS.reshape(2, 4))
  np.testing.assert_array_equal(emb.embedding[ids], logical[np.asarray(ids)])
  np.testing.assert_array_equal(emb.embedding[(ids,)], logical[np.asarray(ids)])
  np.testing.assert_array_equal(emb.embedding[3], logical[3])
  np.testing.assert_array_equal(emb.embedding[:, :2], logical[:, :2])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nnx_embed_attend_code_gives_num_embeddings_logits(built, layout):
  emb = built("explicit", layout)
  _, n, f = LAYOUTS[layout]
  x = jnp.linspace(-1.0, 1.0, 3 * f).reshape(3, f)
  logits = x @ emb.embedding[...].T
  assert logits.shape == (3, n)
  np.testing.assert_allclose(logits, emb.attend(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_set_value_and_item_assignment_load_the_logical_table(built, axis_type, layout):
  emb = built(axis_type, layout)
  _, n, f = LAYOUTS[layout]
  ids = IDS % n
  table = np.asarray(_table(n, f), np.float64)  # a host table, cast to param_dtype
  emb.embedding.set_value(table)
  assert emb.embedding.get_raw_value().dtype == jnp.float32
  np.testing.assert_array_equal(emb(ids), jnp.take(table.astype(np.float32), ids, axis=0))
  np.testing.assert_array_equal(emb.embedding[...], table.astype(np.float32))
  emb.embedding[...] = _table(n, f, scale=-2.0)
  np.testing.assert_array_equal(emb(ids), jnp.take(_table(n, f, scale=-2.0), ids, axis=0))
  physical = np.asarray(emb.physical_table())
  assert physical.shape == emb.plan.padded_shape
  assert not physical[n:].any() and not physical[:, f:].any()  # padding stays zero


@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_shapes_and_dtypes_raise_naming_the_table(built, layout):
  emb = built("explicit", layout)
  _, n, f = LAYOUTS[layout]
  before = np.asarray(emb.embedding[...])
  padded = emb.plan.padded_shape
  with pytest.raises(ValueError, match=rf"embedding: embedding.set_value got a table of shape "
                     rf"\({padded[0]}, {padded[1]}\), expected the logical shape \({n}, {f}\)"):
    emb.embedding.set_value(jnp.zeros(padded))
  with pytest.raises(ValueError, match=r"complex table \(complex64\)"):
    emb.embedding[...] = jnp.zeros((n, f), jnp.complex64)
  with pytest.raises(ValueError, match=rf"shape \({f},\), expected the logical shape.*"
                     r"write the whole table"):
    emb.embedding[0] = jnp.ones((f,))
  np.testing.assert_array_equal(emb.embedding[...], before)


def test_set_value_casts_to_param_dtype():
  emb = embedlib.ShardedEmbed(99, 8, mesh=_mesh("explicit"), sharding="vocab",
                              table_axes=("model",), param_dtype=jnp.bfloat16,
                              rngs=nnx.Rngs(0))
  emb.embedding[...] = _table(99, 8)  # float32
  assert emb.embedding.get_raw_value().dtype == jnp.bfloat16
  np.testing.assert_array_equal(emb.embedding[...], _table(99, 8).astype(jnp.bfloat16))


def test_a_table_that_divides_gets_a_plain_parameter():
  emb = embedlib.ShardedEmbed(100, 8, mesh=_mesh("explicit"), sharding="vocab",
                              table_axes=("model",), rngs=nnx.Rngs(0))
  assert "table_layout" not in emb.embedding.get_metadata()
  assert emb.embedding[...] is emb.embedding.get_raw_value()  # no copy


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_read_logical_and_match_nnx_embed(built, layout):
  emb = built("explicit", layout)
  _, n, f = LAYOUTS[layout]
  ids = IDS % n
  emb.embedding[...] = _table(n, f)
  plain = nnx.Embed(n, f, rngs=nnx.Rngs(0))
  plain.embedding[...] = _table(n, f)
  loss = lambda m: jnp.sum(jnp.tanh(m(ids)) * jnp.arange(f))
  with jax.set_mesh(emb.mesh):
    grad = nnx.grad(loss)(emb)["embedding"]
  want = nnx.grad(loss)(plain)["embedding"][...]
  assert grad.get_raw_value().shape == emb.plan.padded_shape
  assert grad.shape == (n, f)
  np.testing.assert_allclose(grad[...], want, rtol=1e-6, atol=1e-6)


def test_pure_dict_round_trip_is_logical_and_still_looks_up():
  sharding, n, f = LAYOUTS["vocab"]
  emb = embedlib.ShardedEmbed(n, f, mesh=_mesh("explicit"), sharding=sharding,
                              table_axes=("model",), rngs=nnx.Rngs(0))
  pure = nnx.to_pure_dict(nnx.state(emb))
  assert pure["embedding"].shape == (n, f)
  state = nnx.state(emb)
  nnx.replace_by_pure_dict(state, {"embedding": _table(n, f, scale=3.0)})
  nnx.update(emb, state)  # sets the raw value to the logical table: padded per lookup
  ids = IDS % n
  np.testing.assert_array_equal(emb(ids), jnp.take(_table(n, f, scale=3.0), ids, axis=0))
  emb.load_table(emb.embedding[...])  # laid out again, as nnx.Optimizer needs
  assert emb.embedding.get_raw_value().shape == emb.plan.padded_shape


class _Head(nnx.Module):
  """A table looked up and used as the output layer by ``nnx.Embed`` code."""

  def __init__(self, emb):
    self.emb = emb

  def __call__(self, ids):
    rows = self.emb(ids)
    logits = rows @ self.emb.embedding[...].T
    return jnp.mean(jnp.tanh(rows)) - jnp.mean(jax.nn.log_softmax(logits)[:, 0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_adamw_step_through_nnx_optimizer_matches_nnx_embed(layout):
  sharding, n, f = LAYOUTS[layout]
  mesh = _mesh("explicit")
  ids = IDS % n

  def step_of(emb):
    model = _Head(emb)
    model.emb.embedding[...] = _table(n, f)
    opt = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
      loss, grads = nnx.value_and_grad(lambda m: m(ids))(model)
      opt.update(model, grads)
      return loss

    return float(step(model, opt)), model.emb

  with jax.set_mesh(mesh):
    loss, emb = step_of(embedlib.ShardedEmbed(n, f, mesh=mesh, sharding=sharding,
                                              table_axes=("model",), rngs=nnx.Rngs(0)))
  want_loss, plain = step_of(nnx.Embed(n, f, rngs=nnx.Rngs(0)))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert not np.allclose(plain.embedding[...], _table(n, f))  # the step moved the table
  np.testing.assert_allclose(emb.embedding[...], plain.embedding[...], rtol=1e-5, atol=1e-5)
  physical = np.asarray(emb.physical_table())
  assert not physical[n:].any() and not physical[:, f:].any()


class _Only(nnx.Module):
  def __init__(self, emb):
    self.emb = emb

  def __call__(self, ids):
    return jnp.sum(self.emb(ids) * jnp.arange(self.emb.features))


def test_sparse_optimizer_step_updates_the_touched_rows():
  sharding, n, f = LAYOUTS["vocab"]
  mesh = _mesh("explicit")
  ids = IDS % n
  with jax.set_mesh(mesh):
    model = _Only(embedlib.ShardedEmbed(n, f, mesh=mesh, sharding=sharding,
                                        table_axes=("model",), rngs=nnx.Rngs(0)))
    model.emb.embedding[...] = _table(n, f)
    opt = optim.SparseAwareOptimizer(model, None, optim.SparseSGD(0.5))

    @nnx.jit
    def step(model, opt):
      _, grads = optim.value_and_grad(lambda m: m(ids))(model)
      opt.update(model, grads)

    step(model, opt)
  counts = np.bincount(ids, minlength=n)[:, None]
  want = np.asarray(_table(n, f)) - 0.5 * counts * np.arange(f)
  np.testing.assert_allclose(model.emb.embedding[...], want, rtol=1e-6, atol=1e-6)
  assert model.emb.embedding.shape == (n, f)


def test_to_linen_sees_the_logical_table_and_gives_it_back():
  sharding, n, f = LAYOUTS["vocab"]
  mesh = _mesh("explicit")
  ids = jnp.asarray(IDS)
  model = nnx.bridge.to_linen(embedlib.ShardedEmbed, n, f, mesh=mesh, sharding=sharding,
                              table_axes=("model",))
  with jax.set_mesh(mesh):
    variables = model.init(jax.random.key(0), ids)
    leaf = variables["params"]["embedding"]
    assert leaf.shape == (n, f)
    out = model.apply(variables, ids)
    doubled = model.apply({"params": {"embedding": 2 * leaf}}, ids)
  np.testing.assert_array_equal(out, jnp.take(leaf, ids, axis=0))
  np.testing.assert_allclose(doubled, 2 * jnp.take(leaf, ids, axis=0), rtol=1e-6)
