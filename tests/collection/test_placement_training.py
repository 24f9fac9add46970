"""Stacked tables train and checkpoint like tables of their own.

The reference is the same model with every table replicated on one device:
sparse steps (row gradients routed to the owners of a stack's rows) must
give the same tables, slots and losses, and a checkpoint saved from the
stacked layout must restore onto other device counts and placements (and
back). Tolerance: f32 sums in another order, 1e-5 relative.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import embedlib
from embedlib import EmbeddingCollection, FeatureSpec, TableSpec, optim
from embedlib.checkpoint import Checkpointer, logical
from embedlib.training import setup

FEATURES = (
    FeatureSpec("f_big", "big", combiner="mean"),
    FeatureSpec("f_mid", "mid", combiner=None, max_ids_per_sample=2),
    FeatureSpec("f_a", "a", max_ids_per_sample=1),
    FeatureSpec("f_b", "b"),
    FeatureSpec("f_c", "c"),
)
ROWS = {"big": 3000, "mid": 300, "a": 50, "b": 40, "c": 30}
WIDTH = {"big": 8, "mid": 8, "a": 8, "b": 8, "c": 4}
PLACED = {"big": "routed", "mid": "table_row", "a": "table", "b": "table", "c": "table"}


def tables(shardings):
  return [TableSpec(n, ROWS[n], WIDTH[n], sharding=shardings.get(n, "auto")) for n in ROWS]


class Model(nnx.Module):

  def __init__(self, shardings, mesh, rngs, **kw):
    self.embeddings = EmbeddingCollection(tables(shardings), FEATURES, mesh=mesh, batch_size=16,
                                          rngs=rngs, **kw)
    self.head = nnx.Linear(8 + 16 + 8 + 8 + 4, 1, rngs=rngs)

  def __call__(self, x):
    out = self.embeddings(x)
    flat = [out[f.name].reshape(out[f.name].shape[0], -1) for f in FEATURES]
    return self.head(jnp.concatenate(flat, axis=-1))[:, 0]


def batch(seed):
  rng = np.random.default_rng(seed)
  x = {"f_big": rng.integers(-1, 3000, (16, 3)), "f_mid": rng.integers(0, 300, (16, 2)),
       "f_a": rng.integers(0, 50, (16,)), "f_b": rng.integers(-1, 40, (16, 2)),
       "f_c": rng.integers(0, 30, (16, 2))}
  x["f_big"][:8, 0] = 7  # a hot id on every rank
  return {k: jnp.asarray(v) for k, v in x.items()}, jnp.asarray(rng.normal(size=16), jnp.float32)


def build(layout, rule):
  if layout == "stacked8":
    model = Model(PLACED, jax.make_mesh((8,), ("batch",)), nnx.Rngs(0), table_batched=True,
                  devices_per_host=4)
  elif layout == "stacked4":  # other device count, "mid" now split over all four
    model = Model(dict(PLACED, mid="routed"), jax.make_mesh((4,), ("batch",),
                                                          devices=jax.devices()[:4]),
                  nnx.Rngs(1), table_batched=True)
  else:  # one device, every table replicated
    model = Model({}, None, nnx.Rngs(2))
  opt = optim.SparseAwareOptimizer(model, optax.sgd(0.1), rule)
  if model.embeddings.mesh is not None:  # as the training loop does, which a restore relies on
    for module in (model, opt):
      setup._on_mesh(module, model.embeddings.mesh)
  return model, opt


@nnx.jit
def step(model, opt, x, y):
  loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)
  loss, grads = optim.value_and_grad(loss_fn)(model)
  opt.update(model, grads)
  return loss


def logical_tables(model):
  return {n: np.asarray(model.embeddings.logical_table(n)) for n in ROWS}


def stored(model, opt):
  """``split_state``'s tables and slots as the logical numpy arrays a checkpoint holds."""
  out = {}
  for name, item in logical.split_state(model, opt)[1].items():
    x = np.asarray(jax.device_get(item.array))
    value = np.zeros(item.logical_shape, x.dtype)
    for l, n, p in item.runs():
      value[l:l + n] = x[p:p + n, :item.logical_shape[1]] if x.ndim == 2 else x[p:p + n]
    out[name] = value
  return out


def copy_state(src, src_opt, dst, dst_opt, directory, step=0):
  with_ckpt = Checkpointer(str(directory), asynchronous=False)
  with_ckpt.save(step, src, src_opt, {})
  with_ckpt.restore(dst, dst_opt, step)
  with_ckpt.close()


@pytest.mark.parametrize("rule", [pytest.param(optim.SparseSGD(0.5), marks=pytest.mark.slow),
                                  optim.RowWiseAdagrad(0.3)],
                         ids=["sgd", "adagrad"])  # SGD: the same path, a simpler rule
def test_sparse_steps_match_the_replicated_model(rule, tmp_path):
  placed, placed_opt = build("stacked8", rule)
  assert {k.split("/")[-1] for k in placed_opt.keys} >= {"stack_8", "stack_4"}
  ref, ref_opt = build("replicated", rule)
  copy_state(placed, placed_opt, ref, ref_opt, tmp_path)
  for k in range(3):
    x, y = batch(k)
    np.testing.assert_allclose(float(step(placed, placed_opt, x, y)),
                               float(step(ref, ref_opt, x, y)), rtol=1e-5)
  got, want = stored(placed, placed_opt), stored(ref, ref_opt)
  assert set(got) == set(want)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_checkpoint_restores_across_device_counts_and_placements(tmp_path):
  rule = optim.RowWiseAdagrad(0.3)
  placed, placed_opt = build("stacked8", rule)
  x, y = batch(0)
  step(placed, placed_opt, x, y)
  saved = stored(placed, placed_opt)
  # Members are stored under the keys they have as tables of their own.
  assert {k for k in saved if k.startswith("tables/")} == {
      f"tables/embeddings/tables/{n}" for n in ROWS}
  assert saved["tables/embeddings/tables/a"].shape == (50, 8)
  ckpt = Checkpointer(str(tmp_path / "ckpt"), asynchronous=False)
  ckpt.save(1, placed, placed_opt, {"position": 1})
  x, y = batch(1)
  for layout in ("stacked4", "replicated"):
    other, other_opt = build(layout, rule)
    assert ckpt.restore(other, other_opt, 1) == {"position": 1}
    for n, table in logical_tables(other).items():
      np.testing.assert_array_equal(table, saved[f"tables/embeddings/tables/{n}"], err_msg=n)
    back = stored(other, other_opt)
    for key in saved:
      np.testing.assert_array_equal(back[key], saved[key], err_msg=key)
  # And back onto the stacked layout, from the replicated one: the same next step.
  ckpt.save(2, other, other_opt, {})
  again, again_opt = build("stacked8", rule)
  ckpt.restore(again, again_opt, 2)
  ref, ref_opt = build("replicated", rule)
  ckpt.restore(ref, ref_opt, 2)
  ckpt.close()
  np.testing.assert_allclose(float(step(again, again_opt, x, y)), float(step(ref, ref_opt, x, y)),
                             rtol=1e-5)
