"""``TableParam``: a padded table's parameter, a Variable type read logical everywhere.

Tiny stand-ins for the uneven tables that broke the hook-based view: a
vocab table of 9 rows over 4 ranks (as 99 over 4), a hidden table of 6
columns over 4, and a grid whose rows divide no mesh axis (as 1001 x 66 on
2 x 4). The oracle is the stored table cut by numpy (``[:n, :f]`` of the
raw value): every read must equal that slice of it, and ``nnx.Embed``'s
behaviour where one applies.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import variablelib
from jax.sharding import AxisType
from jax.sharding import NamedSharding

import embedlib
from embedlib.param import TableParam

from .contract import make_mesh

# (sharding, num_embeddings, features) on a ("data": 2, "model": 4) mesh.
LAYOUTS = {"vocab": ("vocab", 9, 4), "hidden": ("hidden", 6, 6), "grid": ("grid", 9, 6)}
AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def _mesh(axis_type):
  return make_mesh((2, 4), ("data", "model"), axis_types=(AXIS_TYPES[axis_type],) * 2)


def _build(axis_type, layout):
  sharding, n, f = LAYOUTS[layout]
  emb = embedlib.ShardedEmbed(n, f, mesh=_mesh(axis_type),
                              layout=embedlib.Layout(sharding=sharding), rngs=nnx.Rngs(0))
  emb.load_table(np.arange(n * f, dtype=np.float32).reshape(n, f) / (n * f))
  return emb


@pytest.fixture(scope="module")
def built():
  """``(axis_type, layout) -> ShardedEmbed``, built once per module."""
  cache = {}

  def get(axis_type, layout):
    if (axis_type, layout) not in cache:
      cache[axis_type, layout] = _build(axis_type, layout)
    return cache[axis_type, layout]

  return get


def _oracle(emb):
  n, f = emb.plan.logical_shape
  return np.asarray(emb.embedding.get_raw_value())[:n, :f]


def _bytes_per_device(sharding, shape, itemsize=4):
  """The largest shard's bytes: ``ceil(size / ways)`` per dimension (uneven splits too)."""
  sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes))
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  ways = [int(np.prod([sizes[a] for a in ((s,) if isinstance(s, str) else s or ())]))
          for s in spec]
  return int(np.prod([-(-d // w) for d, w in zip(shape, ways)])) * itemsize


def test_the_stand_ins_are_uneven_and_get_the_type():
  for layout in LAYOUTS:
    emb = _build("explicit", layout)
    assert emb.plan.padded_shape != emb.plan.logical_shape
    assert type(emb.embedding) is TableParam and isinstance(emb.embedding, nnx.Param)
  assert emb.plan.table_spec[0] and emb.plan.table_spec[1]  # the grid splits both


def test_building_and_reading_warn_nothing(built):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    emb = _build("explicit", "vocab")
    emb.embedding[...], emb.embedding.T, emb.embedding[-1]  # pylint: disable=pointless-statement
    emb.embedding[...] = emb.embedding[...] * 2
    nnx.Optimizer(emb, optax.adamw(1e-2), wrt=nnx.Param)
  assert not [str(w.message) for w in caught]


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_read_is_logical(built, axis_type, layout):
  emb = built(axis_type, layout)
  _, n, f = LAYOUTS[layout]
  want = _oracle(emb)
  table = emb.embedding
  assert table.shape == (n, f) and table.size == n * f and table.ndim == 2
  assert len(table) == n and table.dtype == jnp.float32
  np.testing.assert_array_equal(table[...], want)
  np.testing.assert_array_equal(table.get_value(), want)
  np.testing.assert_array_equal(table[-1], want[-1])
  np.testing.assert_array_equal(table[-2:], want[-2:])
  np.testing.assert_array_equal(table[:, f - 1], want[:, f - 1])
  np.testing.assert_array_equal(table[:, -1], want[:, -1])
  np.testing.assert_array_equal(table[jnp.array([n - 1, 0, 2])], want[[n - 1, 0, 2]])
  np.testing.assert_array_equal(table.T, want.T)
  np.testing.assert_array_equal(jnp.asarray(table), want)
  np.testing.assert_array_equal(np.asarray(table), want)
  np.testing.assert_allclose(table * 2 + 1, want * 2 + 1)
  np.testing.assert_allclose(-table, -want)
  x = np.linspace(-1.0, 1.0, 3 * f, dtype=np.float32).reshape(3, f)
  np.testing.assert_allclose(x @ table.T, x @ want.T, rtol=1e-6, atol=1e-6)
  leaf = nnx.state(emb, nnx.Param)["embedding"]
  assert leaf.shape == (n, f)
  np.testing.assert_array_equal(leaf.T, want.T)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_abstract_reads_are_logical_and_the_stored_table_keeps_its_layout(layout, axis_type):
  """What a deviceless compile reads (the plan's memory, the GPU tier) is placed as a built one."""
  sharding, n, f = LAYOUTS[layout]
  mesh = _mesh(axis_type)
  abstract = nnx.eval_shape(lambda: embedlib.ShardedEmbed(
      n, f, mesh=mesh, sharding=sharding, rngs=nnx.Rngs(0)))
  assert abstract.embedding.shape == (n, f)
  assert abstract.embedding[...].shape == (n, f)
  stored = abstract.embedding.get_raw_value()
  assert stored.shape == tuple(abstract.plan.padded_shape)
  # Explicit axes trace it onto the abstract mesh; Auto ones left it unplaced.
  assert stored.sharding is not None and stored.sharding.mesh.shape == mesh.shape
  assert stored.sharding.spec == jax.P(*abstract.plan.table_spec)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_view_in_a_program_keeps_the_stored_layout(built, layout):
  """Traced on Auto axes, the view is split as the table is, unevenly: no bytes move.

  An eager view is a concrete ``jax.Array``, which jax lays out evenly only:
  it takes ``plan.logical_spec``.
  """
  emb = built("auto", layout)
  stored = emb.embedding.get_raw_value().sharding
  seen = []

  @nnx.jit
  def total(emb):
    view = emb.embedding[...]
    jax.debug.inspect_array_sharding(view, callback=seen.append)
    return jnp.sum(view * view)

  np.testing.assert_allclose(total(emb), np.sum(_oracle(emb) ** 2), rtol=1e-6)
  (view,) = seen
  assert view.is_equivalent_to(stored, 2)
  shape = emb.plan.logical_shape
  assert _bytes_per_device(view, shape) <= _bytes_per_device(stored, emb.plan.padded_shape)
  eager = emb.embedding[...].sharding
  assert eager == NamedSharding(emb.mesh, jax.sharding.PartitionSpec(*emb.plan.logical_spec))


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_optimizer_slots_have_the_tables_layout(built, axis_type, layout):
  emb = built(axis_type, layout)
  stored = emb.embedding.get_raw_value()
  with jax.set_mesh(emb.mesh):
    opt = nnx.Optimizer(emb, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)
  slots = [s for s in jax.tree.leaves(nnx.state(opt.opt_state, nnx.Variable),
                                      is_leaf=lambda x: isinstance(x, nnx.Variable))
           if s.get_raw_value().ndim == 2]
  assert len(slots) == 2  # mu, nu
  for slot in slots:
    assert slot.get_raw_value().shape == emb.plan.padded_shape
    assert slot.get_raw_value().sharding == stored.sharding


def test_an_adamw_step_keeps_the_slots_where_the_table_is():
  emb = _build("explicit", "vocab")
  _, n, f = LAYOUTS["vocab"]
  ids = jnp.array([0, n - 1, 3, n - 1], jnp.int32)
  with jax.set_mesh(emb.mesh):
    opt = nnx.Optimizer(emb, optax.adamw(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(emb, opt):
      grads = nnx.grad(lambda m: jnp.sum(m(ids) ** 2))(emb)
      opt.update(emb, grads)

    step(emb, opt)
  stored = emb.embedding.get_raw_value().sharding
  mu = opt.opt_state[0].mu["embedding"].get_raw_value()
  assert mu.sharding == stored and mu.shape == emb.plan.padded_shape
  assert np.asarray(mu)[n - 1].any() and not np.asarray(mu)[n:].any()


def test_linen_files_it_under_params():
  assert variablelib.variable_name_from_type(TableParam) == "params"
  assert variablelib.variable_type_from_name("params") is nnx.Param
  assert TableParam == nnx.Param and hash(TableParam) != hash(nnx.Param)


class _LinearTranspose(nnx.Module):

  def __init__(self, dout, din, *, rngs):
    self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs(), (dout, din)))

  def __call__(self, x):
    return x @ self.kernel.T


class _Encoder(nnx.Module):
  """flax's ``tests/nnx/graph_utils_test.py::test_tied_weights_example``, on a mesh."""

  def __init__(self, mesh, sharding, *, rngs):
    self.embed = embedlib.ShardedEmbed(10, 2, mesh=mesh, sharding=sharding, rngs=rngs)
    self.linear_out = _LinearTranspose(10, 2, rngs=rngs)
    self.linear_out.kernel = self.embed.embedding  # tie the weights

  def __call__(self, x):
    return self.linear_out(self.embed(x))


@pytest.mark.parametrize("sharding", ["replicated", "vocab", "hidden", "grid"])
def test_flax_tied_weights_example_gives_ten_logits(sharding):
  model = _Encoder(_mesh("explicit"), sharding, rngs=nnx.Rngs(0))
  _, state = nnx.split(model)
  assert len(nnx.to_flat_state(state)) == 1
  x = jax.random.randint(jax.random.key(0), (2,), 0, 10)
  y = model(x)
  assert y.shape == (2, 10)
  table = np.asarray(model.embed.logical_table())
  np.testing.assert_allclose(y, table[np.asarray(x)] @ table.T, rtol=1e-6, atol=1e-6)
