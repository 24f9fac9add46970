"""Training a ``DynamicEmbed`` with the sparse optimizers; checkpoints across device counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import checkpoint, dynamic, optim
from embedlib.dynamic import reference as ref_lib
from tests.dynamic import helpers

LR = 0.5     # a power of two: the reference's updates are exact


def _model(devices, **kw):
  kw = {"bucket_size": 4, "eviction": "lru", **kw}
  return embedlib.DynamicEmbed(32, 4, mesh=helpers.mesh(devices), rngs=nnx.Rngs(0), **kw)


@nnx.jit
def _sgd_step(emb, opt, w, cot):
  loss, grads = optim.value_and_grad(lambda m: jnp.sum(m(w) * cot))(emb)
  dynamic.reset_slots(opt, emb)
  opt.update(emb, grads)
  return loss


def _batches(steps, seed=5):
  rng = np.random.default_rng(seed)
  ids = helpers.draw_batches(seed, steps, 16)
  cots = [rng.integers(-3, 4, (16, 4)).astype(np.float32) for _ in range(steps)]
  return ids, cots


@pytest.mark.parametrize("devices", [1, 4, 8])
def test_sgd_rows_equal_reference(devices):
  emb = _model(devices)
  opt = optim.SparseAwareOptimizer(emb, None, optim.SparseSGD(learning_rate=LR))
  ref = ref_lib.Reference(emb.policy)
  table = helpers.ReferenceTable(32, 4, emb.init_key[...])
  evicted = 0
  for ids, cot in zip(*_batches(6)):
    with jax.set_mesh(emb.mesh):
      _sgd_step(emb, opt, dynamic.words(ids), jnp.asarray(cot))
    rows, placed = ref.step(ref_lib.as_uint64(ids))
    table.place(placed)
    table.sgd(rows, cot, LR)
    evicted += ref.stats["evicted"]
  assert evicted > 0                      # the steps exercised eviction's resets
  assert emb.resident() == ref.resident()
  np.testing.assert_array_equal(np.asarray(emb.rows.embedding[...]), table.table)


def test_adagrad_slots_reset_on_eviction():
  emb = embedlib.DynamicEmbed(4, 2, bucket_size=4, eviction="lru", rngs=nnx.Rngs(0))
  opt = optim.SparseAwareOptimizer(emb, None, optim.RowWiseAdagrad(learning_rate=0.1))
  one = jnp.ones((1, 2))
  for i in (10, 11, 12, 13):          # fill the bucket
    _sgd_step(emb, opt, dynamic.words(np.array([i])), one)
  row = emb.resident()[10]
  acc_before = float(opt.slots[0]["acc"][...][row])
  assert acc_before > 0
  _sgd_step(emb, opt, dynamic.words(np.array([99])), 3 * one)   # evicts 10, the oldest
  assert emb.resident().get(99) == row and 10 not in emb.resident()
  assert emb.stats()["evicted"] == 1
  # The row's accumulator restarted: it holds only id 99's squared gradient.
  assert float(opt.slots[0]["acc"][...][row]) == pytest.approx(9.0)


@pytest.mark.parametrize("saved,restored", [(8, 4), (1, 8)])
def test_checkpoint_across_device_counts(tmp_path, saved, restored):
  ids, cots = _batches(5, seed=9)
  runs = []
  for devices in (saved, restored):
    with jax.set_mesh(helpers.mesh(devices)):   # the optimizer's step on the mesh too
      emb = _model(devices, admit_after=2, eviction="lfu", decay_every=2)
      opt = optim.SparseAwareOptimizer(emb, None, optim.SparseSGD(learning_rate=LR))
    runs.append((emb, opt))
  (a, opt_a), (b, opt_b) = runs
  for i, c in zip(ids[:3], cots[:3]):
    with jax.set_mesh(a.mesh):
      _sgd_step(a, opt_a, dynamic.words(i), jnp.asarray(c))
  dense, tables = checkpoint.split_state(a, opt_a)
  # The map is stored split like the rows, never gathered into the dense state.
  assert {"maps/keys_hi", "maps/keys_lo", "maps/score", "maps/placed_at",
          "maps/sketch"} <= set(tables)
  assert set(dense["dense"]) == {"clock", "slots_clock", "init_key", "last"}
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  ckpt.save(3, a, opt_a, {})
  ckpt.wait()
  with jax.set_mesh(b.mesh):
    ckpt.restore(b, opt_b)
  assert b.resident() == a.resident() and int(b.clock[...]) == 3
  assert b.keys_hi[...].addressable_shards[0].data.shape == (32 // restored,)
  for i, c in zip(ids[3:], cots[3:]):
    for emb, opt in runs:
      with jax.set_mesh(emb.mesh):
        _sgd_step(emb, opt, dynamic.words(i), jnp.asarray(c))
  assert b.resident() == a.resident()
  np.testing.assert_array_equal(np.asarray(b.rows.embedding[...]),
                                np.asarray(a.rows.embedding[...]))
  np.testing.assert_array_equal(np.asarray(b.sketch[...]), np.asarray(a.sketch[...]))


def test_routed_table_on_a_2d_mesh_with_split_ids():
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  with jax.set_mesh(mesh):
    emb = embedlib.DynamicEmbed(32, 4, bucket_size=4, mesh=mesh, sharding="routed",
                                table_axes=("model",), data_axes=("data", "model"),
                                rngs=nnx.Rngs(0))
    opt = optim.SparseAwareOptimizer(emb, None, optim.SparseSGD(learning_rate=LR))
  assert emb.rows.plan.strategy == "routed"
  ref = ref_lib.Reference(emb.policy)
  table = helpers.ReferenceTable(32, 4, emb.init_key[...])
  split = jax.NamedSharding(mesh, jax.P(("data", "model")))
  for ids, cot in zip(*_batches(4)):
    w = dynamic.Words(jax.device_put(dynamic.words(ids).value, split))
    with jax.set_mesh(mesh):
      _sgd_step(emb, opt, w, jnp.asarray(cot))
    rows, placed = ref.step(ref_lib.as_uint64(ids))
    table.place(placed)
    table.sgd(rows, cot, LR)
  assert emb.resident() == ref.resident()
  np.testing.assert_array_equal(np.asarray(emb.rows.embedding[...]), table.table)
