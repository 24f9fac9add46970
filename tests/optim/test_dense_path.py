"""The by-rows update path of small tables: taken when it should be, exact.

``apply._local_update`` dedups the ids of a shard with no more rows than the
step has ids by summing them straight into their rows (``dedup_rows``), and
runs the rule on every row of the shard, writing back only the touched ones,
instead of deduplicating its ids (by marks or a sort). It must give
bit-for-bit the by-ids path's tables and slots, on every strategy and rule,
and leave untouched rows exactly as they were, even where the rule's
increment on a zero gradient is NaN (AdaGrad, ``eps=0``, accumulator 0) or
the weight is ``-0.0``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embedlib import optim
from embedlib.optim import allreduce
from embedlib.optim import apply as apply_lib
from embedlib.plan import plan_embedding

from . import reference as ref
from .test_rules import NUM_EMBEDDINGS, make_table, step_pairs

# The XLA ops' own dedup paths (on CPU the fused update would replace them).
pytestmark = pytest.mark.usefixtures("xla_update")


def run_steps(emb, rules, dense: bool, monkeypatch, marks: bool = True):
  """Two steps of every rule: on the by-rows path, or forced onto the by-ids one.

  By ids, rules with a slot mark it unless ``marks`` is False, which forces
  the sort. Returns the final ``{rule: (table, slots)}`` and the number of
  sorts in the compiled step.
  """
  with monkeypatch.context() as m:
    m.setattr(apply_lib, "_use_dense_update", lambda rows, n: dense and rows <= n)
    # The dedups of all-gathered ids: a small whole table's all-reduce
    # (``test_allreduce.py``) sums its ids with a sort of its own.
    m.setattr(allreduce, "pays", lambda *a: False)
    if not marks:
      m.setattr(apply_lib, "_scratch_slot", lambda slots, n: None)
    table = np.array(emb.physical_table())
    state = {
        name: (jax.device_put(table, emb.physical_table().sharding),
               optim.init_slots(rule, emb.plan, emb.mesh))
        for name, rule in rules.items()
    }

    @jax.jit
    def step(state, pairs, k):
      return {
          name: optim.apply_row_grads(
              rules[name], *state[name], pairs, plan=emb.plan, mesh=emb.mesh, step=k)
          for name in rules
      }

    sorts = step.lower(state, step_pairs(0), jnp.int32(0)).as_text().count("stablehlo.sort")
    for k in range(2):
      state = step(state, step_pairs(k), jnp.int32(k))
    return jax.tree.map(np.asarray, state), sorts


# With ``test_rules`` (which, on 13 rows, runs the no-sort path against the
# dense reference on every layout) this keeps the sort path checked. The
# paths are local to a shard, and the 2-D meshes pad as the 1-D ones do
# (13 rows over 2, 4 and 8 ranks), so CI runs no mesh and each strategy once
# on a 2-D mesh, the shards split four ways and eight: rows over 4 ranks
# (vocab) and over 8 (routed over both axes), columns over 8 (hidden over
# both axes), both at once (grid). ``-m slow`` adds the rest of the 2-D
# layouts and the 1-D meshes.
CI_LAYOUTS = ("replicated-nomesh", "vocab-2x4", "routed-2x4-both", "hidden-2x4-both",
              "grid-2x4")
LAYOUTS = [pytest.param(layout, id=ref.layout_id(layout),
                        marks=() if ref.layout_id(layout) in CI_LAYOUTS else pytest.mark.slow)
           for layout in ref.PATH_LAYOUTS]
#: The rules with a slot, which mark it instead of sorting (test_marks_path.py).
SLOT_RULES = ("adagrad", "adam_row", "adam_global")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dense_and_marks_paths_equal_the_sort_path(layout, monkeypatch):
  """The by-rows path (every rule) and the marks path (rules with a slot) equal the sort.

  One test of the three local dedups per layout, so each compiles once: by
  rows, by ids marking a slot, and by ids sorting, the reference of both.
  """
  # 13 rows, 22 ids per step (plus padding): every shard skips the sort.
  emb = make_table(layout)
  rules = {name: ref.make_rule(name, schedule=True) for name in ref.RULES}
  slot_rules = {name: rules[name] for name in SLOT_RULES}
  dense, dense_sorts = run_steps(emb, rules, True, monkeypatch)
  marked, mark_sorts = run_steps(emb, slot_rules, False, monkeypatch)
  by_sort, sorts = run_steps(emb, rules, False, monkeypatch, marks=False)
  assert dense_sorts == 0 and mark_sorts == 0 and sorts > 0, (dense_sorts, mark_sorts, sorts)
  assert_same_states(dense, by_sort, rules)
  assert_same_states(marked, by_sort, slot_rules)
  # The steps did change something (the comparisons are not of no-ops).
  for name in ("sgd", "adagrad"):
    assert not np.array_equal(by_sort[name][0], np.asarray(emb.physical_table())), name


def assert_same_states(got, want, rules):
  """Bit-for-bit equal tables and slots, for every rule."""
  for name in rules:
    np.testing.assert_array_equal(got[name][0], want[name][0], err_msg=name)
    for slot in rules[name].slots():
      np.testing.assert_array_equal(
          got[name][1][slot], want[name][1][slot], err_msg=f"{name}.{slot}")


@functools.cache
def _sorts(rows, num_ids, rule=optim.LazyAdam(0.1)):
  plan = plan_embedding(rows, 4)
  f = jax.jit(lambda t, s, i, g: optim.apply_row_grads(
      rule, t, s, [(i, g)], plan=plan, mesh=None, step=0))
  args = (jnp.zeros((rows, 4)), apply_lib.init_slots(rule, plan, None),
          jnp.zeros((num_ids,), jnp.int32), jnp.zeros((num_ids, 4)))
  return f.lower(*args).as_text().count("stablehlo.sort")


def test_path_is_chosen_from_shapes():
  sgd = optim.SparseSGD(0.1)
  assert _sorts(64, 64) == _sorts(64, 64, sgd) == 0  # rows <= ids: by rows, no sort
  # One row more: by ids, no [rows, ...] temporary. Rules with a slot mark
  # it instead of sorting (test_marks_path.py); SGD has none and sorts.
  assert _sorts(65, 64) == 0 and _sorts(65, 64, sgd) > 0
  assert apply_lib._scratch_slot(apply_lib.init_slots(optim.LazyAdam(0.1), plan_embedding(65, 4), None), 64) == "count"


def test_untouched_rows_exact_with_nan_increments_and_negative_zeros():
  # eps=0 and accumulators at 0: an untouched row's increment is 0/0 = NaN,
  # which must never reach the table (and -0.0 + 0.0 would be +0.0). Row 2
  # is touched with a zero gradient: LazyAdam counts it and decays its
  # moments. 6 rows, 8 ids: the no-sort path.
  plan = plan_embedding(6, 3)
  table = jnp.array([[-0.0, 0.0, 1.5]] * 6)
  ids = jnp.array([0, 2, 0, -1, 4, 9, 4, 4], jnp.int32)
  grads = jnp.arange(24.0).reshape(8, 3) - 7.0
  grads = grads.at[1].set(0.0)
  for rule in (optim.SparseSGD(0.1), optim.RowWiseAdagrad(0.1, eps=0.0),
               optim.LazyAdam(0.1, eps=0.0)):
    slots = apply_lib.init_slots(rule, plan, None)
    if "m" in slots:
      slots = dict(slots, m=slots["m"] + 0.5, v=slots["v"] + 0.25)
    new_table, new_slots = jax.jit(lambda t, s: optim.apply_row_grads(
        rule, t, s, [(ids, grads)], plan=plan, mesh=None, step=0))(table, slots)
    new_table = np.asarray(new_table)
    untouched = np.array([False, True, False, True, False, True])
    got = new_table[untouched].view(np.uint32)
    np.testing.assert_array_equal(got, np.asarray(table)[untouched].view(np.uint32))
    for k, v in new_slots.items():
      np.testing.assert_array_equal(np.asarray(v)[untouched], np.asarray(slots[k])[untouched])
    assert np.isfinite(new_table[[0, 4]]).all(), rule
    if "count" in new_slots:
      assert np.asarray(new_slots["count"]).tolist() == [1, 0, 1, 0, 1, 0]
      np.testing.assert_allclose(np.asarray(new_slots["m"])[2], 0.5 * 0.9)
