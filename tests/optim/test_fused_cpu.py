"""The fused CPU update (``embedlib/optim/fused_cpu.cc``): same tables as the XLA ops, in place.

``tests/optim/test_rules.py`` checks both paths against the dense
references on every layout with a 13-row table. Here: enough ids (12,000,
over twice the 4,096 a thread takes) that the C++ update splits them over
threads, compared with the XLA ops on three layouts and every rule, and
with itself on one CPU, bit for bit; the donated
table updated in place (no copy, no scatter left in the step); an
undonated table left as it was; the XLA ops without the library, with the
switch off, or for a rule or dtype it does not handle. The library's build
and its fallbacks: ``tests/kernels/test_cpu_library.py``.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import optim
from embedlib.kernels import cpu_library
from embedlib.optim import fused_cpu

from . import reference as ref
from ..cpu_kernels import require_cpu_kernels

ROWS, FEATURES, IDS = 20_000, 20, 12_000


def big_layouts():
  wanted = ("replicated-nomesh", "vocab-4", "hidden-2x4")
  return [layout for layout in ref.LAYOUTS if ref.layout_id(layout) in wanted]


def step_pairs(k):
  """Two lookups: Zipf-like ids (many repeats, ~7,000 distinct rows) plus invalid ones."""
  rng = np.random.default_rng(k)
  ids = (rng.zipf(1.2, IDS) * 7919 % (ROWS + 300)).astype(np.int32) - 150  # some < 0 or >= ROWS
  ids[::101] = -1
  first, second = ids[: IDS // 3].reshape(-1, 4), ids[IDS // 3:]
  return [(x, rng.standard_normal(x.shape + (FEATURES,)).astype(np.float32))
          for x in (first, second)]


def run(layout, path_is_fused):
  _, _, sharding, table_axes, data_axes = layout
  emb = embedlib.ShardedEmbed(ROWS, FEATURES, mesh=ref.make_mesh(layout), sharding=sharding,
                              table_axes=table_axes, data_axes=data_axes, rngs=nnx.Rngs(0))
  rules = {name: ref.make_rule(name, schedule=True) for name in ref.RULES}
  with fused_cpu.use(path_is_fused):
    step = jax.jit(lambda state, pairs, k: {
        name: optim.apply_row_grads(rules[name], *state[name], pairs, plan=emb.plan,
                                    mesh=emb.mesh, step=k)
        for name in rules
    }, donate_argnums=0)
    state = {name: (jnp.array(emb.physical_table()), optim.init_slots(rule, emb.plan, emb.mesh))
             for name, rule in rules.items()}
    for k in range(2):
      state = step(state, step_pairs(k), jnp.int32(k))
  return jax.tree.map(np.asarray, state)


@pytest.mark.parametrize("layout", big_layouts(), ids=ref.layout_id)
def test_many_rows_match_the_xla_ops(layout):
  require_cpu_kernels()
  fused, xla = run(layout, True), run(layout, False)
  touched = np.unique(np.concatenate([p[0].ravel() for k in range(2) for p in step_pairs(k)]))
  touched = touched[(touched >= 0) & (touched < ROWS)]
  assert len(touched) > 4 * 1024, len(touched)  # rows in every part of two threads
  for name in ref.RULES:
    # Same sums in the same order; only the sum of squares (AdaGrad) and
    # powf (Adam's corrections) may round an ulp differently.
    got, want = jax.tree.leaves(fused[name]), jax.tree.leaves(xla[name])
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name)
    untouched = np.setdiff1d(np.arange(ROWS), touched)
    np.testing.assert_array_equal(fused[name][0][untouched], xla[name][0][untouched],
                                  err_msg=name)


def test_one_thread_gives_the_same_bits(tmp_path):
  """The rows are split by range over XLA's threads: the results do not depend on their number."""
  require_cpu_kernels()
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) < 2:
    pytest.skip("one CPU: the update already runs on one thread")
  layout = big_layouts()[0]
  out = tmp_path / "one_cpu.npz"
  code = (f"import os; os.sched_setaffinity(0, {{{cpus[0]}}})\n"
          "import numpy as np, jax\n"
          "from tests.optim import test_fused_cpu as t\n"
          "state = t.run(t.big_layouts()[0], True)\n"
          f"np.savez({str(out)!r}, *jax.tree.leaves(state))\n")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=600)
  one = np.load(out)
  both = jax.tree.leaves(run(layout, True))
  assert len(one.files) == len(both)
  for i, want in enumerate(both):
    np.testing.assert_array_equal(one[f"arr_{i}"], want)


def adagrad_step(donate):
  plan = embedlib.plan_embedding(ROWS, FEATURES)
  rule = optim.RowWiseAdagrad(0.1)

  def f(table, slots, ids, grads):
    return optim.apply_row_grads(rule, table, slots, [(ids, grads)], plan=plan, mesh=None, step=0)

  args = (jnp.ones((ROWS, FEATURES)), optim.init_slots(rule, plan, None),
          jnp.array([3, 5, 3, -1], jnp.int32), jnp.ones((4, FEATURES)))
  return jax.jit(f, donate_argnums=(0, 1) if donate else ()), args


def test_donated_table_is_updated_in_place():
  require_cpu_kernels()
  with fused_cpu.use(True):
    step, args = adagrad_step(donate=True)
    compiled = step.lower(*args).compile()
    text = compiled.as_text()
    assert "embedlib_adagrad" in text and "scatter" not in text
    memory = compiled.memory_analysis()
    table_bytes = ROWS * FEATURES * 4
    assert memory.alias_size_in_bytes >= table_bytes, memory   # the table is an output in place
    assert memory.temp_size_in_bytes < table_bytes // 10, memory  # and never copied
    table, slots = step(*args)
  np.testing.assert_allclose(np.asarray(table)[3], 1 - 0.1 * 2 / (2 + 1e-8), rtol=1e-6)
  assert np.asarray(slots["acc"])[3] == 4.0 and np.asarray(slots["acc"])[4] == 0.0


def test_undonated_table_is_left_as_it_was():
  require_cpu_kernels()
  with fused_cpu.use(True):
    step, args = adagrad_step(donate=False)
    table, slots = step(*args)
  assert np.all(np.asarray(args[0]) == 1.0) and not np.asarray(args[1]["acc"]).any()
  np.testing.assert_allclose(np.asarray(table)[5], 1 - 0.1, rtol=1e-6)
  assert np.asarray(slots["acc"])[5] == 1.0


def test_without_the_library_the_xla_ops_run(monkeypatch):
  monkeypatch.setattr(cpu_library, "library", lambda: None)
  with fused_cpu.use(True):
    step, args = adagrad_step(donate=True)
    assert "embedlib_adagrad" not in step.lower(*args).as_text()
    table, _ = step(*args)
    assert np.asarray(table)[3, 0] < 1.0
    with pytest.raises(RuntimeError, match="could not be built or loaded"):
      fused_cpu.update(optim.SparseSGD(0.1), *args[:1], {}, *args[2:], 0.1, 0,
                       first_row=0, first_col=0, features=FEATURES)


def test_switch_off_rules_and_dtypes_it_does_not_handle(monkeypatch):
  require_cpu_kernels()
  table, acc = jnp.zeros((4, 2)), jnp.zeros(4)
  assert fused_cpu.supports(optim.RowWiseAdagrad(0.1), table, {"acc": acc})
  assert not fused_cpu.supports(optim.RowWiseAdagrad(0.1), table.astype(jnp.bfloat16),
                                {"acc": acc})

  class Clipped(optim.SparseSGD):  # its own math: the C++ rules must not stand in
    def update(self, slots, grads, **kw):
      return super().update(slots, jnp.clip(grads, -1, 1), **kw)

  assert not fused_cpu.supports(Clipped(0.1), table, {})
  monkeypatch.setenv(cpu_library.ENV_SWITCH, "0")
  assert not fused_cpu.supports(optim.SparseSGD(0.1), table, {})


@pytest.mark.parametrize("rows", [2_000, 40_000, 5_000_000])
def test_each_rows_gradients_are_summed_in_input_order(rows):
  """Few ids (one thread, one part spanning the table), hot rows at both ends.

  SGD rounds only in the sums, so any other order of a row's gradients
  shows: the rows must match a sequential float32 sum in input order, bit
  for bit.
  """
  require_cpu_kernels()
  rng = np.random.default_rng(rows)
  hot = np.array([0, rows - 1, rows // 2, 7, rows // 3], np.int64)
  ids = np.concatenate([rng.choice(hot, 200), rng.integers(0, rows, 100), [-1, rows, -5]])
  ids = rng.permutation(ids).astype(np.int32)
  grads = (rng.standard_normal((ids.size, 1)) * 10.0 ** rng.integers(-3, 4, (ids.size, 1)))
  grads = grads.astype(np.float32)
  table = np.zeros((rows, 1), np.float32)
  sums = {}
  for i, row in enumerate(ids):
    if 0 <= row < rows:
      sums[int(row)] = sums.get(int(row), np.float32(0)) + grads[i, 0]
  want = table.copy()
  for row, total in sums.items():
    want[row, 0] += np.float32(-0.5) * total
  got, _ = jax.jit(lambda t, i, g: fused_cpu.update(
      optim.SparseSGD(0.5), t, {}, i, g, 0.5, 0, first_row=0, first_col=0, features=1))(
          jnp.asarray(table), jnp.asarray(ids), jnp.asarray(grads))
  np.testing.assert_array_equal(np.asarray(got), want)
