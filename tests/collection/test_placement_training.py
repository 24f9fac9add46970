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
from embedlib.checkpoint import logical

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
  return model, optim.SparseAwareOptimizer(model, optax.sgd(0.1), rule)


@nnx.jit
def step(model, opt, x, y):
  loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)
  loss, grads = optim.value_and_grad(loss_fn)(model)
  opt.update(model, grads)
  return loss


def logical_tables(model):
  return {n: np.asarray(model.embeddings.logical_table(n)) for n in ROWS}


def copy_state(src, src_opt, dst, dst_opt):
  logical.load_logical_state(dst, dst_opt, jax.device_get(logical.logical_state(src, src_opt)))


@pytest.mark.parametrize("rule", [optim.SparseSGD(0.5), optim.RowWiseAdagrad(0.3)],
                         ids=["sgd", "adagrad"])
def test_sparse_steps_match_the_replicated_model(rule):
  placed, placed_opt = build("stacked8", rule)
  assert {k.split("/")[-1] for k in placed_opt.keys} >= {"stack_8", "stack_4"}
  ref, ref_opt = build("replicated", rule)
  copy_state(placed, placed_opt, ref, ref_opt)
  for k in range(3):
    x, y = batch(k)
    np.testing.assert_allclose(float(step(placed, placed_opt, x, y)),
                               float(step(ref, ref_opt, x, y)), rtol=1e-5)
  got, want = logical_tables(placed), logical_tables(ref)
  for n in ROWS:
    np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-6, err_msg=n)
  state, ref_state = logical.logical_state(placed, placed_opt), logical.logical_state(ref, ref_opt)
  for key, slots in ref_state["slots"].items():
    for name, value in slots.items():
      np.testing.assert_allclose(np.asarray(state["slots"][key][name]), np.asarray(value),
                                 rtol=1e-5, atol=1e-6, err_msg=f"{key}.{name}")


def test_checkpoint_restores_across_device_counts_and_placements():
  rule = optim.RowWiseAdagrad(0.3)
  placed, placed_opt = build("stacked8", rule)
  x, y = batch(0)
  step(placed, placed_opt, x, y)
  saved = jax.device_get(logical.logical_state(placed, placed_opt))
  # Members are saved under the keys they have as tables of their own.
  assert set(saved["tables"]) == {f"embeddings/tables/{n}" for n in ROWS}
  assert saved["tables"]["embeddings/tables/a"].shape == (50, 8)
  x, y = batch(1)
  for layout in ("stacked4", "replicated"):
    other, other_opt = build(layout, rule)
    logical.load_logical_state(other, other_opt, saved)
    for n, table in logical_tables(other).items():
      np.testing.assert_array_equal(table, saved["tables"][f"embeddings/tables/{n}"], err_msg=n)
    back = jax.device_get(logical.logical_state(other, other_opt))
    for key in saved["slots"]:
      np.testing.assert_array_equal(back["slots"][key]["acc"], saved["slots"][key]["acc"])
  # And back onto the stacked layout, from the replicated one: the same next step.
  again, again_opt = build("stacked8", rule)
  logical.load_logical_state(again, again_opt, back)
  ref, ref_opt = build("replicated", rule)
  logical.load_logical_state(ref, ref_opt, back)
  np.testing.assert_allclose(float(step(again, again_opt, x, y)), float(step(ref, ref_opt, x, y)),
                             rtol=1e-5)
