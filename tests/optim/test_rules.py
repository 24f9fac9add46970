"""Each row-wise rule against its dense reference, on every layout.

Two steps of ``apply_row_grads`` with two lookups of the table per step
(ids repeated within and across lookups, invalid and out-of-range ids, an
uneven lookup that can't be split over the data shards), then: touched rows
and slots equal the dense reference (float32 against float64: duplicates
are summed in a different order and the rules divide by square roots, so
``rtol=2e-5``), untouched rows and slots are bit-for-bit unchanged, padded
rows and columns stay zero, padded slot entries stay at their initial value,
and every output keeps its layout. All rules of one layout run in one jit
(one compile per test keeps the file fast).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import embedlib
from embedlib import optim

from . import reference as ref

NUM_EMBEDDINGS, FEATURES = 13, 6

# Per step, two lookups: a [4, 3] one and an uneven [10] one. Rows 10 and 11
# are never touched; 13, 20, 100 and -5 are invalid.
STEP_IDS = [
    ([[0, 3, 3], [-1, 12, 5], [5, 5, 7], [20, 1, 0]], [3, 9, 12, 12, -1, 2, 0, 0, 8, 13]),
    ([[1, 1, 12], [6, 0, -1], [12, 2, 2], [4, 4, 4]], [3, 3, 3, 100, -5, 7, 7, 1, 0, 6]),
]


@functools.cache
def step_pairs(k):
  rng = np.random.default_rng(10 + k)
  return [
      (np.asarray(ids, np.int32),
       rng.standard_normal(np.shape(ids) + (FEATURES,)).astype(np.float32))
      for ids in STEP_IDS[k]
  ]


@functools.cache
def make_table(layout):
  _, _, sharding, table_axes, data_axes = layout
  return embedlib.ShardedEmbed(
      NUM_EMBEDDINGS, FEATURES, mesh=ref.make_mesh(layout), sharding=sharding,
      table_axes=table_axes, data_axes=data_axes, rngs=nnx.Rngs(0),
  )


def check_step(name, emb, rule, table, slots, prev, want, touched):
  """Compares one step's physical table and slots with the reference."""
  n, f = NUM_EMBEDDINGS, FEATURES
  got = np.array(table)
  np.testing.assert_allclose(
      got[:n, :f][touched], want[0][touched], rtol=2e-5, atol=1e-6, err_msg=name
  )
  np.testing.assert_array_equal(got[:n][~touched], prev[0][:n][~touched], err_msg=name)
  assert not got[n:].any() and not got[:, f:].any(), f"{name}: padding was written"
  if emb.mesh is not None:
    assert table.sharding.is_equivalent_to(emb.physical_table().sharding, 2), name
  for slot_name, slot in rule.slots().items():
    value, before = np.array(slots[slot_name]), prev[1][slot_name]
    logical = value[:n, :f] if slot.kind == "table" else value[:n]
    msg = f"{name}.{slot_name}"
    np.testing.assert_allclose(
        logical[touched], want[1][slot_name][touched], rtol=2e-5, atol=1e-6, err_msg=msg
    )
    np.testing.assert_array_equal(value[:n][~touched], before[:n][~touched], err_msg=msg)
    init = np.asarray(slot.init, value.dtype)
    np.testing.assert_array_equal(value[n:], init, err_msg=msg)
    if slot.kind == "table":
      np.testing.assert_array_equal(value[:, f:], init, err_msg=msg)
    if emb.mesh is not None:
      layout = NamedSharding(emb.mesh, P(*optim.slot_spec(slot, emb.plan)))
      assert slots[slot_name].sharding.is_equivalent_to(layout, value.ndim), msg


# A schedule only changes the scalar learning rate, computed before the
# layout-specific code: every layout runs with a constant rate, and one
# layout per strategy (single- and multi-device) runs with a schedule too.
# Likewise LazyAdam's global bias correction differs from the per-row one
# only in a scalar: it runs on those layouts and without a mesh.
CASES = [(layout, False) for layout in ref.LAYOUTS] + [
    (layout, True) for layout in ref.LAYOUTS
    if ref.layout_id(layout) in ("replicated-nomesh", "replicated-2x4",
                                 "vocab-2x4-both", "hidden-8")
]


# The XLA ops on every layout; the fused CPU and sorted updates (local paths)
# on the layouts that pad apart (``ref.PATH_LAYOUTS``). A schedule reaches
# each path as one traced scalar whatever the layout, so the scheduled
# layouts rotate through the paths: each path and each scheduled layout once.
PATHS = ("fused", "xla", "sorted")
SCHEDULE_PATHS = {"replicated-nomesh": "fused", "replicated-2x4": "sorted",
                  "vocab-2x4-both": "xla", "hidden-8": "fused"}
PATH_CASES = [(layout, schedule, path) for layout, schedule in CASES
              for path in PATHS
              if (path == SCHEDULE_PATHS[ref.layout_id(layout)] if schedule
                  else path == "xla" or layout in ref.PATH_LAYOUTS)]

# CI runs every layout once with a constant rate, every path without a mesh,
# and every scheduled case. The multi-device path layouts (meshes 2 and 8,
# 2x4, 2x4 over both axes) take the three paths in turn, so each path meets
# every kind of mesh and every strategy but the grid (one layout); the 1- and
# 4-device layouts have the XLA ops only. ``-m slow`` adds the rest: every
# path on every path layout.
CI_PATHS = {ref.layout_id(layout): PATHS[k % len(PATHS)]
            for k, layout in enumerate(l for l in ref.PATH_LAYOUTS if l[0] is not None)}


def _in_ci(layout, schedule, path):
  return schedule or layout[0] is None or CI_PATHS.get(ref.layout_id(layout), "xla") == path


@pytest.mark.parametrize("layout,schedule,update_path", [
    pytest.param(l, s, p, id=ref.layout_id(l) + ("-schedule" if s else "") + f"-{p}",
                 marks=() if _in_ci(l, s, p) else pytest.mark.slow)
    for l, s, p in PATH_CASES
], indirect=["update_path"])
def test_rules_match_dense_reference(layout, schedule, update_path):
  emb = make_table(layout)
  names = ref.RULES if schedule or layout[0] is None else ref.LAYOUT_RULES
  rules = {name: ref.make_rule(name, schedule) for name in names}
  physical = np.array(emb.physical_table())
  sharding = emb.physical_table().sharding
  state = {
      name: (jax.device_put(physical, sharding),
             optim.init_slots(rule, emb.plan, emb.mesh))
      for name, rule in rules.items()
  }
  want = {
      name: (np.asarray(emb.logical_table(), np.float64),
             ref.init_slots(rule, NUM_EMBEDDINGS, FEATURES))
      for name, rule in rules.items()
  }

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, pairs, k):
    return {
        name: optim.apply_row_grads(
            rules[name], *state[name], pairs, plan=emb.plan, mesh=emb.mesh, step=k)
        for name in rules
    }

  for k in range(2):
    pairs = step_pairs(k)
    prev = {name: (np.array(t), {s: np.array(v) for s, v in slots.items()})
            for name, (t, slots) in state.items()}
    state = step(state, pairs, jnp.int32(k))
    for name, rule in rules.items():
      *want[name], touched = ref.dense_step(rule, *want[name], pairs, k)
      check_step(name, emb, rule, *state[name], prev[name], want[name], touched)


@pytest.mark.parametrize("make,match", [
    (lambda: optim.SparseSGD("0.1"), r"SparseSGD: learning_rate='0.1' is neither a number"),
    (lambda: optim.RowWiseAdagrad(0.1, eps=-1e-8), r"RowWiseAdagrad: eps=-1e-08; pass a number >= 0"),
    (lambda: optim.RowWiseAdagrad(0.1, initial_accumulator_value=-0.1),
     r"initial_accumulator_value=-0.1"),
    (lambda: optim.LazyAdam(0.1, b1=1.0), r"LazyAdam: b1=1.0; a moment's decay must be in \[0, 1\)"),
    (lambda: optim.LazyAdam(0.1, b2=-0.5), r"b2=-0.5"),
], ids=["lr", "eps", "initial_acc", "b1", "b2"])
def test_bad_hyperparameters_are_named(make, match):
  with pytest.raises((TypeError, ValueError), match=match):
    make()


def test_schedules_and_numpy_scalars_act_as_the_numbers_they_give():
  # A schedule is called with the step count; an int or numpy learning rate
  # is that number; numpy hyperparameters give the update Python floats give,
  # in float32 (a float64 numpy scalar must not widen the slots).
  schedule = optim.RowWiseAdagrad(optax.linear_schedule(0.1, 0.0, 10))
  assert [float(schedule.lr(jnp.int32(k))) for k in (0, 5, 10)] == pytest.approx([0.1, 0.05, 0.0])
  assert float(optim.SparseSGD(1).lr(jnp.int32(3))) == 1.0
  grads = jnp.array([[0.5, -1.0, 2.0], [0.0, 3.0, -0.25]], jnp.float32)
  slots = {"m": jnp.full((2, 3), 0.1), "v": jnp.full((2, 3), 0.2),
           "count": jnp.array([0, 4], jnp.int32)}
  results = []
  for rule in (optim.LazyAdam(np.float32(0.01), b1=np.float64(0.8)), optim.LazyAdam(0.01, b1=0.8)):
    results.append(rule.update(slots, grads, row_sq_mean=None, lr=rule.lr(jnp.int32(0)),
                               step=jnp.int32(0)))
  (numpy_inc, numpy_slots), (float_inc, float_slots) = results
  assert numpy_inc.dtype == jnp.float32 and bool(jnp.all(numpy_inc != 0))
  np.testing.assert_array_equal(numpy_inc, float_inc)
  for name, value in float_slots.items():
    assert numpy_slots[name].dtype == value.dtype, name
    np.testing.assert_array_equal(numpy_slots[name], value)
