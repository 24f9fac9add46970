"""Small whole tables all-reduce their row gradients: the all-gather's update, in fewer bytes.

The all-gather path is the reference (``tests/optim/test_rules.py`` checks
it against the dense rules on every layout). The all-reduce sums each
rank's gradients, then the ranks' sums: another order, so float32 with
``rtol=1e-5``; touched rows are the same, bit for bit.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import optim
from embedlib.optim import allreduce
from embedlib.plan import cost, hlo

ROWS, FEATURES = 40, 16
LAYOUTS = {
    "replicated-8": ((8,), ("batch",), "replicated", {}),
    "hidden-8": ((8,), ("batch",), "hidden", {}),
    "hidden-4x2-both": ((4, 2), ("data", "model"), "hidden", {"table_axes": ("data", "model")}),
    "replicated-2x4": ((2, 4), ("data", "model"), "replicated", {}),
}


def _setup(layout, rows=ROWS):
  shape, names, strategy, axes = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])
  emb = embedlib.ShardedEmbed(rows, FEATURES, mesh=mesh, sharding=strategy,
                              rngs=nnx.Rngs(0), **axes)
  rng = np.random.default_rng(2)
  ids = rng.integers(-1, rows + 3, (8 * 24,)).astype(np.int32)  # invalid ones too
  ids[ids == 5] = 6
  grads = rng.standard_normal((ids.size, FEATURES)).astype(np.float32)
  # Row 5 is hit on two ranks with gradients that cancel: touched all the same.
  ids[[0, -1]] = 5
  grads[-1] = -grads[0]
  pairs = [(ids, grads),
           (ids[:32].reshape(8, 4), rng.standard_normal((8, 4, FEATURES)).astype(np.float32))]
  return emb, pairs


def _compiled(emb, rule, pairs):
  slots = optim.init_slots(rule, emb.plan, emb.mesh)
  fn = jax.jit(lambda t, s, p: optim.apply_row_grads(rule, t, s, p, plan=emb.plan,
                                                     mesh=emb.mesh, step=0))
  return fn, slots


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_allreduced_update_equals_the_all_gather(layout, monkeypatch):
  emb, pairs = _setup(layout)
  local_ids = (pairs[0][0].size + pairs[1][0].size) // emb.plan.data_shards
  assert allreduce.pays(emb.plan, local_ids, 4)
  rule = optim.LazyAdam(0.1)
  fn, slots = _compiled(emb, rule, pairs)
  assert "all-gather" not in fn.lower(emb.physical_table(), slots, pairs).compile().as_text()
  got = jax.device_get(fn(emb.physical_table(), slots, pairs))
  monkeypatch.setattr(allreduce, "pays", lambda *a: False)
  fn, slots = _compiled(emb, rule, pairs)
  want = jax.device_get(fn(emb.physical_table(), slots, pairs))
  for name, value in got[1].items():
    # Touched rows (row 5's cancelling gradients included) step their moments.
    np.testing.assert_array_equal(value != 0, want[1][name] != 0, err_msg=name)
    np.testing.assert_allclose(value, want[1][name], rtol=1e-5, atol=1e-6, err_msg=name)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  assert (got[0] != np.asarray(emb.physical_table())).any()


def test_allreduce_moves_what_the_cost_model_says(monkeypatch):
  emb, pairs = _setup("replicated-8")
  rule = optim.SparseSGD(0.1)
  moved = lambda: hlo.bytes_moved(jax.jit(
      lambda t, p: optim.apply_row_grads(rule, t, {}, p, plan=emb.plan, mesh=emb.mesh, step=0)
  ).lower(emb.physical_table(), pairs).compile().as_text())
  local = (8 * 24 + 32) // 8
  assert moved() == cost.allreduce_bytes(ROWS, 8, FEATURES)
  monkeypatch.setattr(allreduce, "pays", lambda *a: False)
  assert moved() == cost.gather_pairs_bytes(local, 8, FEATURES, 4)
  assert cost.allreduce_bytes(ROWS, 8, FEATURES) < cost.gather_pairs_bytes(local, 8, FEATURES, 4)


def test_large_or_row_split_tables_keep_their_distribution():
  local = 28
  big = _setup("replicated-8", rows=8 * local)[0].plan  # more rows than half the batch's ids
  assert not allreduce.pays(big, local, 4)
  mesh = jax.make_mesh((8,), ("batch",))
  for strategy in ("vocab", "routed"):
    plan = embedlib.plan_embedding(ROWS, FEATURES, mesh=mesh, sharding=strategy)
    assert not allreduce.pays(plan, local, 4)
  alone = embedlib.plan_embedding(ROWS, FEATURES, mesh=jax.make_mesh((1,), ("batch",)),
                                  sharding="replicated")
  assert not allreduce.pays(alone, local, 4)
