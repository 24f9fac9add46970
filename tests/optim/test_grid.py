"""The sparse optimizers on grid tables against the dense single-device reference.

A grid splits rows over ``table_axes`` and columns over ``column_axes`` at
once: each row's summed gradient must reach every rank holding one of its
column slices, and RowWiseAdagrad's mean of squares stays over the whole
row. Two steps of SparseSGD, RowWiseAdagrad and LazyAdam on 99-row tables
padded in both dimensions (rows over a data axis and columns over a model
axis, and the other way round), on every update path (fused CPU, XLA ops,
sorted); ``tests/optim/test_rules.py`` runs the 13-row grid of
``reference.LAYOUTS``. Float32 against float64 with sums in another order
and square roots: ``rtol=2e-5``, as there.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import embedlib
from embedlib import optim

from . import reference as ref

ROWS = 99
#: (features, table_axes, column_axes): padded (100, 10) with the rows over
#: the data axis, and (100, 12) with the columns over the model axis.
GRIDS = {
    "rows-tensor": (9, "tensor", "fsdp"),
    "rows-fsdp": (10, "fsdp", "tensor"),
}


@functools.cache
def make_table(grid):
  features, table_axes, column_axes = GRIDS[grid]
  mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
  return embedlib.ShardedEmbed(ROWS, features, mesh=mesh, sharding="grid",
                               table_axes=table_axes, column_axes=column_axes,
                               rngs=nnx.Rngs(0))


def step_pairs(k, features):
  """Two lookups per step: repeated ids, invalid ones, the last row, an uneven count."""
  rng = np.random.default_rng(k)
  a = rng.integers(-3, ROWS + 3, size=(6, 5)).astype(np.int32)
  b = np.array([98, 98, 0, 49, 50, -1, 24, 25, 74, 75, 3], np.int32)
  return [(ids, rng.standard_normal(ids.shape + (features,)).astype(np.float32))
          for ids in (a, b)]


@pytest.mark.parametrize("grid", list(GRIDS))
def test_grid_steps_match_dense_reference(grid, update_path):
  emb = make_table(grid)
  n, f = ROWS, emb.features
  assert emb.plan.padded_shape[0] > n and emb.plan.padded_shape[1] >= f
  rules = {name: ref.make_rule(name, schedule=False) for name in ref.LAYOUT_RULES}
  sharding = emb.physical_table().sharding
  physical = np.array(emb.physical_table())
  state = {name: (jax.device_put(physical, sharding), optim.init_slots(rule, emb.plan, emb.mesh))
           for name, rule in rules.items()}
  want = {name: (np.asarray(emb.logical_table(), np.float64), ref.init_slots(rule, n, f))
          for name, rule in rules.items()}

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, pairs, k):
    return {name: optim.apply_row_grads(rules[name], *state[name], pairs, plan=emb.plan,
                                        mesh=emb.mesh, step=k)
            for name in rules}

  for k in range(2):
    pairs = step_pairs(k, f)
    before = {name: np.array(t) for name, (t, _) in state.items()}
    state = step(state, pairs, jnp.int32(k))
    for name, rule in rules.items():
      *want[name], touched = ref.dense_step(rule, *want[name], pairs, k)
      table, slots = state[name]
      assert table.sharding.is_equivalent_to(sharding, 2), name
      got = np.array(table)
      np.testing.assert_allclose(got[:n, :f][touched], want[name][0][touched],
                                 rtol=2e-5, atol=1e-6, err_msg=name)
      np.testing.assert_array_equal(got[:n, :f][~touched], before[name][:n, :f][~touched],
                                    err_msg=name)
      assert not got[n:].any() and not got[:, f:].any(), f"{name}: padding was written"
      for slot_name, slot in rule.slots().items():
        value = np.array(slots[slot_name])
        logical = value[:n, :f] if slot.kind == "table" else value[:n]
        np.testing.assert_allclose(logical[touched], want[name][1][slot_name][touched],
                                   rtol=2e-5, atol=1e-6, err_msg=f"{name}.{slot_name}")
        np.testing.assert_array_equal(value[n:], np.asarray(slot.init, value.dtype))
        layout = NamedSharding(emb.mesh, P(*optim.slot_spec(slot, emb.plan)))
        assert slots[slot_name].sharding.is_equivalent_to(layout, value.ndim), slot_name


def test_grid_slots_split_rows_and_columns():
  """Row slots follow the rows (whole over the column axes), table slots the table."""
  emb = make_table("rows-fsdp")
  slots = optim.init_slots(optim.LazyAdam(0.1), emb.plan, emb.mesh)
  assert slots["count"].shape == (100,)
  assert slots["count"].sharding.shard_shape((100,)) == (50,)
  assert slots["m"].shape == (100, 12)
  assert slots["m"].sharding.shard_shape((100, 12)) == (50, 3)
