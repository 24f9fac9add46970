"""Every strategy x mesh x awkward size equals the single-device reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from tests.embed.contract import build, check_contract, make_mesh, random_case

# (mesh shape, axis names, table_axes, data_axes): ids replicated over the
# table group (tensor-parallel), token-sharded (data axes = table axes, the
# recommender layout), mixed, and the seed's replica-outside-the-group mesh.
MESHES = {
    "1": ((1,), ("batch",), None, None),
    "2-tp": ((2,), ("model",), None, None),
    "3-tokens": ((3,), ("batch",), None, None),
    "4-tp": ((4,), ("model",), None, None),
    "5-tokens": ((5,), ("batch",), None, None),
    "8-tokens": ((8,), ("batch",), None, None),
    "2x4-tp": ((2, 4), ("data", "model"), None, None),
    "4x2-mixed": ((4, 2), ("data", "model"), ("model", "data"), ("data",)),
    "2x4-replica": ((2, 4), ("replica", "batch"), ("batch",), None),
}
SIZES = [(1, 3), (7, 1), (99, 100), (51865, 3), (50257, 128), (7, 128)]
STRATEGIES = ["replicated", "vocab", "hidden", "routed"]


def _cases():
  # Every mesh with every strategy, at one size each; the sizes rotate, so each
  # strategy meets every size over the meshes (and tests/test_properties.py
  # draws random ones).
  for i, name in enumerate(MESHES):
    for j, strategy in enumerate(STRATEGIES):
      size = SIZES[(i + j) % len(SIZES)]
      yield pytest.param(name, strategy, size, id=f"{name}-{strategy}-{size[0]}x{size[1]}")


@pytest.mark.parametrize("mesh_name, strategy, size", list(_cases()))
def test_layout_matches_reference(mesh_name, strategy, size):
  shape, names, table_axes, data_axes = MESHES[mesh_name]
  mesh = make_mesh(shape, names)
  emb = build(*size, mesh, sharding=strategy, table_axes=table_axes, data_axes=data_axes)
  assert emb.plan.strategy == strategy
  ids, query = random_case(*size, batch=11)  # 11 tokens divide no mesh here
  check_contract(emb, ids, query)


def _covering(meshes, ci):
  """Every (mesh, strategy) pair; those outside ``ci`` run under ``-m slow``.

  ``ci`` pairs each strategy with one mesh and each mesh with some strategy:
  a dtype or kernel meets every strategy and every mesh in CI, and every
  layout meets the reference in test_layout_matches_reference.
  """
  return [pytest.param(m, s, id=f"{m}-{s}",
                       marks=() if (m, s) in ci else pytest.mark.slow)
          for m in meshes for s in STRATEGIES]


@pytest.mark.parametrize("mesh_name, strategy", _covering(
    ["2x4-tp", "8-tokens"],
    {("2x4-tp", "vocab"), ("2x4-tp", "hidden"), ("8-tokens", "replicated"),
     ("8-tokens", "routed")}))
def test_bf16(mesh_name, strategy):
  shape, names, table_axes, data_axes = MESHES[mesh_name]
  emb = build(99, 100, make_mesh(shape, names), sharding=strategy,
              param_dtype=jnp.bfloat16, table_axes=table_axes, data_axes=data_axes)
  ids, query = random_case(99, 100, batch=16, dtype=jnp.bfloat16)
  check_contract(emb, ids, query, rtol=2e-2, grad_atol=32 * 2.0**-8)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_auto_axis_types(strategy):
  mesh = make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  emb = build(99, 100, mesh, sharding=strategy, table_axes=("model", "data"), data_axes=("data",))
  ids, query = random_case(99, 100, batch=6)
  check_contract(emb, ids, query)


@pytest.mark.parametrize("strategy", ["vocab", "hidden", "routed"])
def test_sharded_ids_stay_sharded(strategy):
  """Ids already split over the data axes go in and come out split."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = make_mesh((8,), ("batch",))
  emb = build(1000, 24, mesh, sharding=strategy)
  ids = jax.device_put(jnp.arange(64, dtype=jnp.int32).reshape(16, 4) * 7,
                       NamedSharding(mesh, P("batch")))
  out = emb(ids)
  assert out.sharding.spec[0] == "batch"
  np.testing.assert_array_equal(
      np.asarray(out), np.asarray(emb.logical_table())[np.asarray(ids)])


# Ids replicated over the table group, and token-sharded over part of it
# (the all-token 8-device mesh takes the same local lookups as the mixed one).
@pytest.mark.parametrize("mesh_name, strategy", _covering(
    ["2x4-tp", "4x2-mixed"],
    {("2x4-tp", "replicated"), ("2x4-tp", "hidden"), ("4x2-mixed", "vocab"),
     ("4x2-mixed", "routed")}))
def test_pallas_kernel_in_interpret_mode(mesh_name, strategy):
  """The Pallas gather (interpreted on CPU) as every strategy's local lookup."""
  shape, names, table_axes, data_axes = MESHES[mesh_name]
  emb = build(99, 100, make_mesh(shape, names), sharding=strategy, kernel="pallas",
              table_axes=table_axes, data_axes=data_axes)
  check_contract(emb, *random_case(99, 100, batch=11))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_batch(strategy):
  """An empty batch looks up nothing and gets no gradient, ids replicated over the group.

  tests/embed/test_empty.py covers the token-sharded meshes (8 devices, and
  a mixed 2 x 4 one), where the layouts all-gather ids over the group and
  XLA rejects a collective over a zero-size dimension (found by
  tests/test_properties.py).
  """
  mesh_name = "2x4-tp"
  from flax import nnx

  shape, names, table_axes, data_axes = MESHES[mesh_name]
  emb = build(37, 12, make_mesh(shape, names), sharding=strategy,
              table_axes=table_axes, data_axes=data_axes)
  ids = np.zeros((0, 3), np.int32)
  assert emb(ids).shape == (0, 3, 12)
  assert emb.bag(ids, combiner="mean").shape == (0, 12)
  assert emb.attend(np.zeros((0, 12), np.float32)).shape == (0, 37)

  def loss(m, i):
    return jnp.sum(m(i)) + jnp.sum(m.bag(i)) + jnp.sum(m.attend(jnp.zeros((0, 12))))

  grads = nnx.jit(nnx.grad(loss))(emb, jnp.asarray(ids))
  assert not np.asarray(grads.embedding[...]).any()


@pytest.mark.parametrize("strategy", ["vocab", "hidden"])
@pytest.mark.parametrize("mesh_name", ["8-tokens", "2-tp"])
def test_pallas_bags_of_width_zero(mesh_name, strategy):
  """Weighted bags with no slots pool to zeros with the Pallas kernel too.

  A Pallas bag call on zero-size blocks failed to compile inside shard_map
  (a raw XLA 'func.call op expected at least one operand ... GlobalToLocalShape';
  found by tests/test_properties.py); such bags take the XLA bag.
  """
  from flax import nnx

  shape, names, table_axes, data_axes = MESHES[mesh_name]
  emb = build(37, 12, make_mesh(shape, names), sharding=strategy, kernel="pallas",
              table_axes=table_axes, data_axes=data_axes)
  ids, weights = np.zeros((3, 0), np.int32), np.ones((3, 0), np.float32)
  for combiner in ("sum", "mean"):
    out = emb.bag(ids, weights, combiner=combiner)
    assert out.shape == (3, 12) and not np.asarray(out).any()
  grads = nnx.jit(nnx.grad(lambda m, i, w: jnp.sum(m.bag(i, w))))(
      emb, jnp.asarray(ids), jnp.asarray(weights))
  assert not np.asarray(grads.embedding[...]).any()


# Grid (2-D) layouts: (mesh shape, axis names, table_axes (rows), column_axes).
# FSDP x tensor parallel as flax's Gemma example trains (rows over tensor,
# columns over fsdp: the columns' ranks hold other tokens), the transpose
# (rows' ranks hold other tokens), and both groups holding other tokens.
GRID_MESHES = {
    "fsdp2xtensor4": ((2, 4), ("fsdp", "tensor"), ("tensor",), ("fsdp",)),
    "data4xmodel2": ((4, 2), ("data", "model"), ("data",), ("model",)),
    "data2xfsdp2xtensor2": ((2, 2, 2), ("data", "fsdp", "tensor"), ("tensor", "data"),
                            ("fsdp",)),
}


GRID_SIZES = [(99, 10), (7, 128), (50257, 3)]


def _grid_cases():
  # Every mesh splits rows over 4 ranks and columns over 2, so the sizes pad
  # alike on each: in CI each mesh takes one size and each size one mesh;
  # ``-m slow`` runs the rest of the product.
  for i, mesh_name in enumerate(GRID_MESHES):
    for j, size in enumerate(GRID_SIZES):
      yield pytest.param(mesh_name, size, id=f"{mesh_name}-{size[0]}x{size[1]}",
                         marks=() if i == j else pytest.mark.slow)


@pytest.mark.parametrize("mesh_name, size", list(_grid_cases()))
def test_grid_matches_reference(mesh_name, size):
  shape, names, rows, cols = GRID_MESHES[mesh_name]
  emb = build(*size, make_mesh(shape, names), sharding="grid", table_axes=rows,
              column_axes=cols)
  assert emb.plan.strategy == "grid" and set(emb.plan.table_axes) == set(rows)
  assert emb.plan.column_axes == cols
  check_contract(emb, *random_case(*size, batch=11))


@pytest.mark.parametrize("variant", ["pallas", "bf16", "auto-axes"])
def test_grid_kernels_dtypes_and_axis_types(variant):
  shape, names, rows, cols = GRID_MESHES["fsdp2xtensor4"]
  types = (AxisType.Auto,) * 2 if variant == "auto-axes" else None
  dtype = jnp.bfloat16 if variant == "bf16" else jnp.float32
  emb = build(99, 10, make_mesh(shape, names, axis_types=types), sharding="grid",
              table_axes=rows, column_axes=cols, param_dtype=dtype,
              kernel="pallas" if variant == "pallas" else "auto")
  ids, query = random_case(99, 10, batch=11, dtype=dtype)
  if variant == "bf16":
    check_contract(emb, ids, query, rtol=2e-2, grad_atol=32 * 2.0**-8)
  else:
    check_contract(emb, ids, query)
