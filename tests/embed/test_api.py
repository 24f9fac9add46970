"""ShardedEmbed as a drop-in nnx.Embed: signatures, training, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental import checkify
from jax.sharding import PartitionSpec as P

import embedlib
from embedlib import _compat
from tests.embed.contract import make_mesh


class Tagger(nnx.Module):
  """A small model written for nnx.Embed; ``embed_cls`` swaps the table."""

  def __init__(self, embed_cls, rngs, **embed_kwargs):
    self.embed = embed_cls(50, 12, rngs=rngs, **embed_kwargs)
    self.dense = nnx.Linear(12, 4, rngs=rngs)

  def __call__(self, ids):
    return self.dense(jnp.tanh(self.embed(ids)).mean(axis=1))


class ScaledEmbed(embedlib.ShardedEmbed):
  """As in flax's Gemma example, with only the base class switched."""

  def __call__(self, x):
    return super().__call__(x) * jnp.sqrt(self.features).astype(self.dtype)


def _ids(batch=8, seq=5, vocab=50, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, seq)), jnp.int32)


@pytest.mark.parametrize("sharding", ["replicated", "vocab", "hidden"])
def test_drop_in_model_same_outputs_and_training(sharding):
  mesh = make_mesh((2, 4), ("data", "model"))
  plain = Tagger(nnx.Embed, nnx.Rngs(0))
  sharded = Tagger(embedlib.ShardedEmbed, nnx.Rngs(0), mesh=mesh, sharding=sharding)
  ids, labels = _ids(), jnp.arange(8) % 4
  if _compat.JAX_VERSION < (0, 11):
    np.testing.assert_array_equal(plain(ids), sharded(ids))
  else:  # the sharded draw's last bits (see embedlib/table.py)
    np.testing.assert_allclose(plain(ids), sharded(ids), rtol=1e-6, atol=1e-7)

  def loss_fn(model):
    logits = model(ids)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = []
  for model in (plain, sharded):
    opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    losses.append([float(step(model, opt)) for _ in range(3)])
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
  np.testing.assert_allclose(plain.embed.embedding[...], sharded.embed.logical_table(),
                             rtol=1e-5, atol=1e-6)


def test_subclass_of_the_gemma_kind():
  mesh = make_mesh((8,), ("batch",))
  emb = ScaledEmbed(50, 12, mesh=mesh, sharding="hidden", rngs=nnx.Rngs(0))
  ref = nnx.Embed(50, 12, rngs=nnx.Rngs(0))
  ids = _ids()
  np.testing.assert_allclose(emb(ids), ref(ids) * jnp.sqrt(12.0), rtol=1e-6)


def test_mesh_from_set_mesh_and_outside_any_context():
  mesh = make_mesh((2, 4), ("data", "model"))
  with jax.set_mesh(mesh):
    inside = embedlib.ShardedEmbed(8192, 64, rngs=nnx.Rngs(0))
  assert inside.mesh == mesh and inside.plan.strategy == "hidden"
  outside = embedlib.ShardedEmbed(8192, 64, mesh=mesh, rngs=nnx.Rngs(0))
  ids = _ids(vocab=8192)
  np.testing.assert_array_equal(inside(ids), outside(ids))
  assert embedlib.ShardedEmbed(4, 2, rngs=nnx.Rngs(0)).mesh is None


def test_parameter_carries_its_sharding():
  mesh = make_mesh((2, 4), ("data", "model"))
  emb = embedlib.ShardedEmbed(99, 100, mesh=mesh, sharding="vocab", rngs=nnx.Rngs(0))
  spec = nnx.get_partition_spec(nnx.state(emb))["embedding"].get_value()
  assert spec == P(("model",), None)
  assert emb.physical_table().sharding.spec == P(("model",), None)
  assert emb.plan.padded_shape == (100, 100)  # 99 rows padded to 4 ranks
  assert emb.embedding.shape == (99, 100)  # but the parameter reads logical


def test_scalar_and_unsigned_ids_and_out_sharding():
  mesh = make_mesh((8,), ("batch",))
  emb = embedlib.ShardedEmbed(10, 4, mesh=mesh, sharding="vocab", rngs=nnx.Rngs(0))
  table = np.asarray(emb.logical_table())
  np.testing.assert_array_equal(emb(jnp.int32(3)), table[3])
  np.testing.assert_array_equal(emb(jnp.array([3, 12], jnp.uint32)),
                                np.stack([table[3], np.zeros(4)]))
  out = emb(jnp.arange(16) % 10, out_sharding=P("batch"))
  assert out.sharding.spec[0] == "batch"
  assert emb(jnp.arange(16) % 10).sharding.spec[0] is None  # as the ids came


def test_load_and_logical_table_round_trip_through_padding():
  mesh = make_mesh((8,), ("batch",))
  emb = embedlib.ShardedEmbed(7, 3, mesh=mesh, sharding="hidden", rngs=nnx.Rngs(0))
  table = jnp.arange(21.0).reshape(7, 3)
  emb.load_table(table)
  assert emb.physical_table().shape == (7, 8) and emb.embedding.shape == (7, 3)
  np.testing.assert_array_equal(emb.logical_table(), table)
  assert not np.asarray(emb.physical_table())[:, 3:].any()
  with pytest.raises(ValueError, match=r"logical shape \(7, 3\)"):
    emb.load_table(jnp.zeros((7, 8)))


def test_invalid_ids_are_zero_by_default_and_nnx_embed_differs():
  emb = embedlib.ShardedEmbed(5, 2, rngs=nnx.Rngs(0))
  ref = nnx.Embed(5, 2, rngs=nnx.Rngs(0))
  ids = jnp.array([-1, 5, 2])
  out = emb(ids)
  assert not np.asarray(out[:2]).any()
  np.testing.assert_array_equal(out[2], ref(ids)[2])
  assert np.isnan(np.asarray(ref(ids)[1])).all()  # the documented difference


@pytest.mark.parametrize("mesh_shape", [None, (2, 4)], ids=["no-mesh", "explicit-2x4"])
def test_invalid_ids_as_errors(mesh_shape):
  # jax.make_mesh's default axes are Explicit, where a check ahead of the
  # shard_map used to fail to trace.
  mesh = mesh_shape and make_mesh(mesh_shape, ("data", "model"))
  emb = embedlib.ShardedEmbed(5, 2, invalid_ids="error", name="user_id", mesh=mesh,
                              rngs=nnx.Rngs(0))
  with pytest.raises(IndexError, match=r"user_id: id 9 .* outside \[0, 5\)"):
    emb(jnp.array([1, 9]))
  graphdef, state = nnx.split(emb)
  checked = checkify.checkify(jax.jit(lambda s, i: nnx.merge(graphdef, s)(i)))
  err, _ = checked(state, jnp.array([1, 9]))
  with pytest.raises(checkify.JaxRuntimeError, match=r"id 9 is outside \[0, 5\)"):
    err.throw()
  err, out = checked(state, jnp.array([1, 4]))
  assert err.get() is None and out.shape == (2, 2)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(sharding="rows"), ValueError, "'rows'.*'vocab'"),
        (dict(table_axes=("tensor",)), ValueError, "'tensor'.*\\('data', 'model'\\)"),
        (dict(kernel="cuda"), ValueError, "cuda"),
        (dict(invalid_ids="clip"), ValueError, "'clip'.*'zero'"),
    ],
)
def test_construction_errors(kwargs, error, pattern):
  mesh = make_mesh((2, 4), ("data", "model"))
  with pytest.raises(error, match=pattern):
    embedlib.ShardedEmbed(10, 4, mesh=mesh, rngs=nnx.Rngs(0), **kwargs)


def test_non_integer_ids_raise_like_nnx_embed():
  emb = embedlib.ShardedEmbed(5, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="Input type must be an integer"):
    emb(jnp.array([1.0]))
  with pytest.raises(ValueError, match="features=2"):
    emb.attend(jnp.ones((3, 4)))


def test_abstract_mesh_module_builds_under_eval_shape():
  mesh = make_mesh((2, 4), ("data", "model"))
  abstract = mesh.abstract_mesh
  with jax.sharding.use_abstract_mesh(abstract):
    emb = nnx.eval_shape(lambda: embedlib.ShardedEmbed(
        99, 100, mesh=abstract, sharding="vocab", name="item", rngs=nnx.Rngs(0)))
  assert emb.embedding.shape == (99, 100)  # abstract, and logical too
  assert emb.plan.table_axes == ("model",)
  assert emb.embedding.get_raw_value().shape == (100, 100)
  assert emb.embedding.get_raw_value().sharding.spec == P(("model",), None)
  # A host table is placed shard by shard onto devices, which an abstract mesh lacks.
  with pytest.raises(ValueError, match="item: load_table needs a concrete mesh"):
    emb.load_table(np.zeros((99, 100), np.float32))


def test_error_mode_bags_take_minus_one_as_padding():
  emb = embedlib.ShardedEmbed(5, 2, invalid_ids="error", name="user_id", rngs=nnx.Rngs(0))
  out = emb.bag(jnp.array([[1, -1], [4, 4]]))
  np.testing.assert_allclose(out[0], emb(jnp.array([1]))[0])
  with pytest.raises(IndexError, match=r"user_id: id -2"):
    emb.bag(jnp.array([[1, -2]]))
  with pytest.raises(IndexError, match=r"user_id: id -1"):
    emb(jnp.array([1, -1]))  # unpooled: -1 is an invalid id
  graphdef, state = nnx.split(emb)
  checked = checkify.checkify(jax.jit(lambda s, i: nnx.merge(graphdef, s).bag(i)))
  assert checked(state, jnp.array([[1, -1]]))[0].get() is None
  assert "id 7" in checked(state, jnp.array([[7, -1]]))[0].get()
