"""The sorted update (every platform but CPU): same rows as the XLA ops, and deterministic.

Its results against the rules' dense references, on every layout, are
``test_rules.py``'s (the ``update_path`` fixture runs it); that its CUDA
lowering has no scatter with colliding indices is ``test_gpu_lowering.py``'s.
Here: where each row's gradients are summed in the same order as the XLA
ops sum them (at most two ids per row), the tables and slots are the XLA
ops' bit for bit; with a hot row of many ids, two runs give the same bits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embedlib import optim
from embedlib.optim import fused_cpu, sorted_update
from embedlib.plan import plan_embedding

RULES = {
    "sgd": optim.SparseSGD(0.3),
    "adagrad": optim.RowWiseAdagrad(0.3, eps=1e-3),
    "adam": optim.LazyAdam(0.3, b1=0.8, b2=0.95),
}


def run(rule, ids, grads, *, sorted_path, rows=50, features=6):
  plan = plan_embedding(rows, features)
  table = jax.random.normal(jax.random.PRNGKey(0), (rows, features))
  slots = optim.init_slots(rule, plan, None)
  with fused_cpu.use(False), sorted_update.use(sorted_path):
    step = jax.jit(lambda t, s, i, g: optim.apply_row_grads(
        rule, t, s, [(i, g)], plan=plan, mesh=None, step=0))
    return jax.tree.map(np.asarray, step(table, slots, ids, grads))


@pytest.mark.parametrize("name", sorted(RULES))
def test_equals_xla_ops_bit_for_bit_when_order_is_the_same(name):
  # Rows 3 and 7 twice, row 9 once, invalid ids; no row more than twice.
  ids = jnp.array([7, 3, -1, 9, 3, 60, 7], jnp.int32)
  grads = jax.random.normal(jax.random.PRNGKey(1), (7, 6))
  got = run(RULES[name], ids, grads, sorted_path=True)
  want = run(RULES[name], ids, grads, sorted_path=False)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(g, w)


def test_hot_row_is_summed_the_same_every_run():
  ids = jnp.concatenate([jnp.full((300,), 5), jnp.arange(40) % 13]).astype(jnp.int32)
  grads = jax.random.normal(jax.random.PRNGKey(2), (340, 6)) * 1e3
  first = run(RULES["adagrad"], ids, grads, sorted_path=True)
  second = run(RULES["adagrad"], ids, grads, sorted_path=True)   # traced and run again
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(a, b)
  want = run(RULES["adagrad"], ids, grads, sorted_path=False)
  for g, w in zip(jax.tree.leaves(first), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
