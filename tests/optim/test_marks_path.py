"""The by-ids update path that marks a slot instead of sorting: equal to the sort path, bit for bit.

``apply._local_update`` dedups the ids of a shard with more rows than the
step has ids by writing each id's position into its row of one of the
rule's slots and reading the winner back (``dedup_marks``). It must give the
sort path's tables and slots exactly, on every layout and rule with a slot,
leave every untouched row and slot value as it was, and never copy the
marked slot (``tests/optim/test_memory.py`` bounds the temporaries).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embedlib import optim
from embedlib.optim import apply as apply_lib
from embedlib.plan import plan_embedding

# The XLA ops' own dedup paths (on CPU the fused update would replace them).
pytestmark = pytest.mark.usefixtures("xla_update")

# The marks path equals the sort path, on every layout and rule with a slot:
# test_dense_path.py's test_dense_and_marks_paths_equal_the_sort_path, which
# compiles the three local dedups of each layout in one test.


def test_dedup_marks_sums_each_row_once_in_input_order():
  idx = jnp.array([5, 2, 5, 9, 2, 5, 0, 7], jnp.int32)  # 9 and 7 skipped (rows=7)
  grads = jnp.arange(16.0).reshape(8, 2)
  scratch = jnp.full((7,), 3.5)
  first, sums, marked = apply_lib.dedup_marks(jnp.minimum(idx, 7), grads, scratch)
  got = {int(r): np.asarray(sums[i]) for i, r in enumerate(first.tolist()) if r < 7}
  assert sorted(got) == [0, 2, 5]
  np.testing.assert_array_equal(got[5], grads[0] + grads[2] + grads[5])
  np.testing.assert_array_equal(got[2], grads[1] + grads[4])
  np.testing.assert_array_equal(got[0], grads[6])
  # Untouched rows of the scratch keep their values; the touched ones are marks.
  np.testing.assert_array_equal(np.asarray(marked)[[1, 3, 4, 6]], 3.5)


def test_untouched_rows_and_slots_exact_and_a_nan_slot_stays_in_its_row():
  """A NaN accumulator on one touched row spoils that row only, never a neighbour's dedup."""
  plan = plan_embedding(40, 3)
  rule = optim.RowWiseAdagrad(0.1)
  table = jnp.arange(120.0).reshape(40, 3) / 7
  ids = jnp.array([3, 8, 3, 30, -1, 8, 8, 12], jnp.int32)
  grads = jnp.arange(24.0).reshape(8, 3) - 5.0
  acc = jnp.linspace(0.0, 1.0, 40)
  run = jax.jit(lambda t, a: optim.apply_row_grads(
      rule, t, {"acc": a}, [(ids, grads)], plan=plan, mesh=None, step=0))
  clean_t, clean_s = run(table, acc)
  nan_t, nan_s = run(table, acc.at[30].set(jnp.nan))
  others = np.array([r != 30 for r in range(40)])
  np.testing.assert_array_equal(np.asarray(nan_t)[others], np.asarray(clean_t)[others])
  np.testing.assert_array_equal(np.asarray(nan_s["acc"])[others], np.asarray(clean_s["acc"])[others])
  untouched = np.array([r not in (3, 8, 12, 30) for r in range(40)])
  np.testing.assert_array_equal(np.asarray(clean_t)[untouched], np.asarray(table)[untouched])
  np.testing.assert_array_equal(np.asarray(clean_s["acc"])[untouched], np.asarray(acc)[untouched])


def test_marked_slot_is_updated_in_place():
  """No copy of the marked slot in the compiled update (XLA would add one without the reads' data dependency)."""
  plan = plan_embedding(100_000, 8)
  for rule in (optim.RowWiseAdagrad(0.1), optim.LazyAdam(0.1)):
    slots = optim.init_slots(rule, plan, None)
    f = jax.jit(lambda t, s, i, g: optim.apply_row_grads(
        rule, t, s, [(i, g)], plan=plan, mesh=None, step=0), donate_argnums=(0, 1))
    hlo = f.lower(jnp.zeros((100_000, 8)), slots, jnp.zeros((512,), jnp.int32),
                  jnp.zeros((512, 8))).compile().as_text()
    copies = [line for line in hlo.splitlines() if " copy(" in line and "100000" in line]
    assert not copies, copies
