"""A mixed dense + sparse train step against a dense single-device reference.

``value_and_grad`` must give the loss, the dense gradients of ``nnx.grad``
and row gradients whose per-id sum is the table gradient; a
``SparseAwareOptimizer`` step must move the dense parameters like optax and
the table like the row-wise rule on the touched rows. Float32 against a
float32 reference with sums in another order: ``rtol=1e-5``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import embedlib
from embedlib import kernels, optim

from . import reference as ref

N, F = 13, 6
IDS_A = np.array([[0, 3, 3], [-1, 12, 5], [5, 5, 7], [20, 1, 0]], np.int32)
IDS_B = np.array([3, 9, 12, 12, -1, 2, 0, 0, 8, 13], np.int32)


class Model(nnx.Module):
  """One table looked up twice, a dense scale and a running counter."""

  def __init__(self, *, rngs, **embed_kwargs):
    self.emb = embedlib.ShardedEmbed(N, F, rngs=rngs, **embed_kwargs)
    self.w = nnx.Param(jnp.linspace(0.5, 1.5, F))
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

  def __call__(self, a, b):
    self.calls[...] += 1
    return loss_on(self.emb(a), self.emb(b), self.w[...])


def loss_on(rows_a, rows_b, w):
  return jnp.sum(jnp.tanh(rows_a * w)) + 0.5 * jnp.sum(rows_b**2 * w)


def reference_loss(table, w):
  take = lambda ids: kernels.gather_reference(table, jnp.where(ids < N, ids, -1))
  return loss_on(take(IDS_A), take(IDS_B), w)


def scatter_rows(pairs):
  grad = np.zeros((N, F))
  for ids, g in pairs:
    ids, g = np.asarray(ids).reshape(-1), np.asarray(g).reshape(-1, F)
    ok = (ids >= 0) & (ids < N)
    np.add.at(grad, ids[ok], g[ok])
  return grad


E2E_LAYOUTS = [
    layout for layout in ref.LAYOUTS
    if ref.layout_id(layout) in ("replicated-nomesh", "vocab-8", "vocab-2x4",
                                 "hidden-2x4-both")
]


@pytest.mark.parametrize("layout", E2E_LAYOUTS, ids=ref.layout_id)
def test_mixed_train_step_matches_reference(layout):
  _, _, sharding, table_axes, data_axes = layout
  model = Model(rngs=nnx.Rngs(0), mesh=ref.make_mesh(layout), sharding=sharding,
                table_axes=table_axes, data_axes=data_axes)
  rule = optim.RowWiseAdagrad(optax.exponential_decay(0.3, 1, 0.5), eps=1e-3)
  tx = optax.adam(0.05)
  opt = optim.SparseAwareOptimizer(model, tx, rule)

  @nnx.jit(donate_argnums=(0, 1))
  def train_step(model, opt, a, b):
    loss, grads = optim.value_and_grad(lambda m: m(a, b))(model)
    opt.update(model, grads)
    return loss, grads

  table = np.asarray(model.emb.logical_table(), np.float64)
  slots = ref.init_slots(rule, N, F)
  w = jnp.array(np.array(model.w[...]))  # a copy: the step donates the model
  w_state = tx.init(w)
  for k in range(2):
    want_loss, (g_table, g_w) = jax.value_and_grad(reference_loss, (0, 1))(
        jnp.asarray(table, jnp.float32), w)
    loss, grads = train_step(model, opt, IDS_A, IDS_B)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grads.dense["w"][...], g_w, rtol=1e-5, atol=1e-6)
    assert set(grads.rows) == {"emb"} and len(grads.rows["emb"]) == 2
    np.testing.assert_allclose(scatter_rows(grads.rows["emb"]), g_table, rtol=1e-5, atol=1e-6)

    touched = np.zeros(N, bool)
    touched[[i for i in np.r_[IDS_A.ravel(), IDS_B] if 0 <= i < N]] = True
    table, slots = ref.dense_update(rule, table, slots, g_table, touched, k)
    updates, w_state = tx.update(g_w, w_state, w)
    w = optax.apply_updates(w, updates)
    np.testing.assert_allclose(model.emb.logical_table(), table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.w[...], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(opt.slots[0]["acc"][...])[:N], slots["acc"], rtol=1e-5)
  assert int(model.calls[...]) == 2, "state changed by the loss was not kept"
  assert int(opt.step[...]) == 2
  if model.emb.mesh is not None:
    assert model.emb.physical_table().sharding.is_equivalent_to(model.emb._sharding(), 2)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_pooled_bag_coefficients_give_row_gradients(combiner):
  """A pooled lookup reports each id's coefficient in its bag."""
  emb = embedlib.ShardedEmbed(N, F, rngs=nnx.Rngs(0))
  ids = jnp.array([[1, 4, 4, -1], [2, 2, 0, 7]], jnp.int32)
  bag_weights = jnp.array([[0.5, 0.25, 0.25, 1.0], [1.0, 2.0, -1.0, 0.5]])
  weights = jnp.arange(2 * F, dtype=jnp.float32).reshape(2, F) / 7
  coef = kernels.bag_coefficients(ids, bag_weights, N, combiner)

  def pooled(table):
    return jnp.sum(coef[..., None] * kernels.gather_reference(table, ids), axis=1)

  def loss_fn(emb):
    return jnp.sum(jnp.sin(emb.bag(ids, bag_weights, combiner=combiner)) * weights)

  _, grads = optim.value_and_grad(loss_fn)(emb)
  want = jax.grad(lambda t: jnp.sum(jnp.sin(pooled(t)) * weights))(emb.embedding[...])
  (got_ids, row_grads), = grads.rows[""]
  assert row_grads.shape == ids.shape + (F,)
  np.testing.assert_allclose(scatter_rows([(got_ids, row_grads)]), want, rtol=1e-5, atol=1e-6)


class Tied(nnx.Module):
  def __init__(self, rngs):
    self.emb = embedlib.ShardedEmbed(N, F, rngs=rngs)
    self.ctx = embedlib.ShardedEmbed(N, F, rngs=rngs)

  def __call__(self, ids):
    return jnp.sum(self.emb.attend(self.ctx(ids)) ** 2)


def test_attend_needs_dense_training_and_tables_selects_it():
  model = Tied(nnx.Rngs(0))
  ids = jnp.array([1, 2, 2])
  with pytest.raises(ValueError, match="'emb': attend"):
    optim.value_and_grad(lambda m: m(ids))(model)
  sparse_only_ctx = lambda key, module: key != "emb"
  opt = optim.SparseAwareOptimizer(model, optax.sgd(0.1), optim.SparseSGD(0.1),
                                   tables=sparse_only_ctx)
  _, grads = optim.value_and_grad(lambda m: m(ids), tables=sparse_only_ctx)(model)
  assert set(grads.rows) == {"ctx"}
  assert grads.dense["emb"]["embedding"][...].shape == (N, F)
  before = np.array(model.emb.embedding[...])
  opt.update(model, grads)
  assert (np.array(model.emb.embedding[...]) != before).all(axis=1).sum() > 3  # dense


def test_update_rejects_row_gradients_of_unknown_tables():
  model = Tied(nnx.Rngs(0))
  opt = optim.SparseAwareOptimizer(model, optax.sgd(0.1), optim.SparseSGD(0.1),
                                   tables=lambda key, m: key == "ctx")
  grads = optim.Grads(dense={}, rows={"emb": ((jnp.array([1]), jnp.ones((1, F))),)})
  with pytest.raises(ValueError, match=r"\['emb'\].*same tables= selection"):
    opt.update(model, grads)


class DenseOnly(nnx.Module):
  def __init__(self, rngs):
    self.emb = nnx.Embed(N, F, rngs=rngs)

  def __call__(self, ids):
    return jnp.sum(self.emb(ids) ** 2)


def test_optimizer_errors_name_the_mistake_and_the_fix():
  rule = optim.SparseSGD(0.1)
  with pytest.raises(ValueError, match=r"no ShardedEmbed table .*drop-in for nnx.Embed"):
    optim.SparseAwareOptimizer(DenseOnly(nnx.Rngs(0)), optax.sgd(0.1), rule)
  model = Model(rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"no ShardedEmbed that tables= selects"):
    optim.SparseAwareOptimizer(model, optax.sgd(0.1), rule, tables=lambda key, m: False)
  # tx=None would leave the dense scale ``w`` untrained, silently.
  with pytest.raises(ValueError, match=r"tx=None, but \['w'\] are dense trainable"):
    optim.SparseAwareOptimizer(model, None, rule)
  # ... unless the wrt filter leaves it out on purpose.
  frozen = optim.SparseAwareOptimizer(model, None, rule, wrt=nnx.PathContains("emb"))
  assert frozen.dense is None
  opt = optim.SparseAwareOptimizer(model, optax.sgd(0.1), rule)
  a, b = jnp.asarray(IDS_A), jnp.asarray(IDS_B)
  dense_grads = nnx.grad(lambda m: m(a, b))(model)
  with pytest.raises(TypeError, match=r"grads is a State, not the Grads of "
                     r"embedlib.optim.value_and_grad"):
    opt.update(model, dense_grads)


@pytest.mark.parametrize("rule,tx", [
    (optim.SparseSGD(0.1), optax.sgd(0.1)),
    (optim.LazyAdam(0.1, bias_correction="row"), optax.adam(0.1)),
    (optim.LazyAdam(0.1, bias_correction="global"), optax.adam(0.1)),
], ids=["sgd", "adam_row", "adam_global"])
def test_every_row_touched_equals_optax(rule, tx):
  """With every row in every batch, the lazy rules are optax's dense rules."""
  plan = embedlib.plan_embedding(5, 3)
  table = jax.random.normal(jax.random.key(0), (5, 3))
  slots, dense, state = optim.init_slots(rule, plan, None), table, tx.init(table)
  ids = jnp.array([4, 3, 2, 1, 0, 0])
  step = jax.jit(functools.partial(optim.apply_row_grads, rule, plan=plan, mesh=None))
  for k in range(3):
    g = jax.random.normal(jax.random.key(k + 1), (6, 3))
    table, slots = step(table, slots, [(ids, g)], step=k)
    updates, state = tx.update(jnp.zeros((5, 3)).at[ids].add(g), state, dense)
    dense = optax.apply_updates(dense, updates)
  np.testing.assert_allclose(table, dense, rtol=1e-5, atol=1e-6)
