"""No table-sized temporary: the compiled sparse step's scratch memory.

XLA's memory analysis of the whole jitted, donated train step (lookup,
``value_and_grad``, ``SparseAwareOptimizer.update`` with row-wise AdaGrad
and Adam for a dense parameter) gives its temporary bytes per device. They must
not depend on ``num_embeddings`` and must stay within a small multiple of the
looked-up rows' bytes; the dense ``nnx.Optimizer(optax.adagrad)`` step on
the same model is measured beside it and grows with the table, which shows
the check can fail. Only compiled, never run. Both update paths: the XLA
ops and, on CPU, the fused C++ update, whose own scratch (a hash table of
2 to 4 ints per id and the touched rows' sums, at most ``[ids, features]``
floats: ``kernels/cpu/row_update.cc``) is outside XLA's analysis and
ids-sized by construction.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import embedlib
from embedlib import optim

from . import reference as ref

FEATURES, BATCH, HOT = 32, 256, 4
ROWS_BYTES = BATCH * HOT * FEATURES * 4  # the looked-up rows, whole batch
SMALL, LARGE = 20_000, 200_000
NO_SORT = BATCH * HOT  # rows <= ids: the no-sort update path of small tables
MiB = 1 << 20


class Model(nnx.Module):
  def __init__(self, num_embeddings, *, rngs, **embed_kwargs):
    self.emb = embedlib.ShardedEmbed(num_embeddings, FEATURES, rngs=rngs, **embed_kwargs)
    # Element-wise, not nnx.Linear: on an Explicit mesh a Linear's kernel
    # gradient contracts the sharded batch and needs an out_sharding.
    self.scale = nnx.Param(jnp.linspace(0.5, 1.5, FEATURES))

  def __call__(self, ids):
    return jnp.mean(jnp.sum(self.emb(ids).sum(1) * self.scale[...], -1) ** 2)


@functools.cache
def _built(layout, num_embeddings, sparse: bool):
  """The model and optimizer, split; shared by the update paths (only compiled, never run)."""
  _, _, sharding, table_axes, data_axes = layout
  model = Model(num_embeddings, rngs=nnx.Rngs(0), mesh=ref.make_mesh(layout), sharding=sharding,
                table_axes=table_axes, data_axes=data_axes)
  if sparse:
    opt = optim.SparseAwareOptimizer(model, optax.adam(1e-3), optim.RowWiseAdagrad(0.1))
  else:
    opt = nnx.Optimizer(model, optax.adagrad(0.1), wrt=nnx.Param)
  # Built for real (at most 25 MB): nnx.eval_shape can't build a ShardedEmbed
  # without a mesh, since embedlib.sharding.current_mesh() calls get_mesh in a trace.
  return nnx.split((model, opt))


@pytest.fixture(scope="module", autouse=True)
def _free_the_built_models():
  yield
  _built.cache_clear()  # up to 25 MB a table: not kept for the worker's next file


def temp_bytes(layout, num_embeddings, sparse: bool) -> int:
  mesh = ref.make_mesh(layout)
  graphdef, state = _built(layout, num_embeddings, sparse)

  def step(state, ids):
    model, opt = nnx.merge(graphdef, state)
    if sparse:
      loss, grads = optim.value_and_grad(lambda m: m(ids))(model)
    else:
      loss, grads = nnx.value_and_grad(lambda m: m(ids))(model)
    opt.update(model, grads)
    return loss, nnx.state((model, opt))

  ids = jax.ShapeDtypeStruct((BATCH, HOT), jnp.int32)
  if mesh is not None:
    ids = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(model_data_axes(layout))))
  compiled = jax.jit(step, donate_argnums=0).lower(state, ids).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def model_data_axes(layout):
  return embedlib.plan_embedding(8, 8, mesh=ref.make_mesh(layout)).data_axes or None


MEMORY_LAYOUTS = [
    layout for layout in ref.LAYOUTS
    if ref.layout_id(layout) in ("replicated-nomesh", "vocab-4", "hidden-2x4")
]
GRID = [layout for layout in ref.LAYOUTS if ref.layout_id(layout) == "grid-2x4"]


PATHS = ("fused", "xla", "sorted")


def _cases(layouts, ci):
  """Every (update path, layout); those outside ``ci`` run under ``-m slow``."""
  return [pytest.param(layout, path, id=f"{path}-{ref.layout_id(layout)}",
                       marks=() if (path, ref.layout_id(layout)) in ci else pytest.mark.slow)
          for path in PATHS for layout in layouts]


# CI runs each layout once and each path at least once: the fused update
# (the CPU's) without a mesh, the sorted one (the GPU's) on the row-split
# layouts, the XLA ops on hidden; ``-m slow`` runs every path on every layout.
@pytest.mark.parametrize("layout,update_path", _cases(MEMORY_LAYOUTS + GRID, {
    ("fused", "replicated-nomesh"), ("sorted", "vocab-4"), ("xla", "hidden-2x4"),
    ("sorted", "grid-2x4")}), indirect=["update_path"])
def test_sparse_step_has_no_table_sized_temporary(layout, update_path):
  small, large = (temp_bytes(layout, n, sparse=True) for n in (SMALL, LARGE))
  assert abs(large - small) <= 64 * 1024, (small, large)
  assert large <= 4 * ROWS_BYTES, (large, ROWS_BYTES)  # measured: 2.5x to 2.8x


# The by-rows update of small tables is in the XLA ops alone (the fused and
# sorted updates take no branch on the row count, so here they repeat the
# test above on a smaller table): CI runs the XLA ops on every layout,
# ``-m slow`` adds the other two paths.
@pytest.mark.parametrize("layout,update_path", _cases(MEMORY_LAYOUTS, {
    ("xla", ref.layout_id(layout)) for layout in MEMORY_LAYOUTS}), indirect=["update_path"])
def test_small_table_update_within_rows_bytes(layout, update_path):
  # A table with as many rows as the step has ids skips the sort
  # (``apply._use_dense_update``): its [rows, ...] temporaries must stay
  # within the same bound as the sort path's [ids, ...] ones.
  small = temp_bytes(layout, NO_SORT, sparse=True)
  assert small <= 4 * ROWS_BYTES, (small, ROWS_BYTES)


def test_dense_step_does_have_one():
  layout = MEMORY_LAYOUTS[0]
  small, large = (temp_bytes(layout, n, sparse=False) for n in (SMALL, LARGE))
  assert large - small >= (LARGE - SMALL) * FEATURES * 4 // 2, (small, large)
