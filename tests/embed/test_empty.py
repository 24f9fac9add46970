"""Ids with a zero-sized dimension give empty (or all-zero) results, as ``nnx.Embed`` does.

Issue 24: ``(4, 0)`` ids on a mesh crashed every layout with the default
CPU kernel. Each layout x kernel builds one tiny module (a 10 x 4 table)
and runs every entry point on empty ids in one jitted program, so a case
costs one compile; the tests then read its results. The module's ``dtype``
(bfloat16) differs from its ``param_dtype`` so that the dtype check can
fail. Expected values: no rows at all, zeros for empty bags (sum, mean and
sqrtn alike, as for an all-padding bag) and a zero gradient.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import embedlib
from embedlib import optim
from embedlib.strategies.request import Request

N, F = 10, 4
DTYPE = jnp.bfloat16
STRATEGIES = ["replicated", "vocab", "hidden", "routed"]
KERNELS = ["auto", "xla", "pallas", "cpu"]
# Explicit axes (``jax.make_mesh``'s default) and Auto ones; each entry:
# (mesh shape, names, axis types, table_axes, data_axes).
MESHES = {
    "none": None,
    "8": ((8,), ("batch",), None, None, None),
    "2x4-auto": ((2, 4), ("data", "model"), (AxisType.Auto,) * 2, ("model", "data"),
                 ("data",)),
    # A grid: rows over tensor, columns over fsdp (the data axis).
    "2x4-grid": ((2, 4), ("fsdp", "tensor"), None, ("tensor",), None),
}
# Every kernel on the Explicit mesh; the default kernel elsewhere.
CASES = [(m, s, "auto") for m in ("none", "2x4-auto") for s in STRATEGIES] + [
    ("8", s, k) for s in STRATEGIES for k in KERNELS] + [
    ("2x4-grid", "grid", k) for k in ("auto", "pallas")]


def _mesh(name):
  if MESHES[name] is None:
    return None, {}
  shape, names, types, table_axes, data_axes = MESHES[name]
  mesh = jax.make_mesh(shape, names, axis_types=types)
  return mesh, {"table_axes": table_axes, "data_axes": data_axes}


def build(mesh_name, strategy, kernel, **kw):
  mesh, axes = _mesh(mesh_name)
  return embedlib.ShardedEmbed(N, F, mesh=mesh, sharding=strategy, kernel=kernel, dtype=DTYPE,
                               rngs=nnx.Rngs(0), **axes, **kw)


def _ids(*shape):
  return jnp.zeros(shape, jnp.int32)


@nnx.jit
def _every_entry_point(emb):
  """Every lookup of empty ids, and the gradient through them: one program."""
  out = {
      "call (4, 0)": emb(_ids(4, 0)),
      "call (0,)": emb(_ids(0)),
      "call (0, 3)": emb(_ids(0, 3)),
      "bag (0, 3)": emb.bag(_ids(0, 3), combiner="mean"),
      "bag (4, 0) mean": emb.bag(_ids(4, 0), jnp.ones((4, 0)), combiner="mean"),
      "attend (0, F)": emb.attend(jnp.zeros((0, F))),
      "dedup (4, 0)": emb.lookup_requests((Request(_ids(4, 0)),), num_unique=4)[0],
      "dedup (0, 3)": emb.lookup_requests((Request(_ids(0, 3), None, "sum"),),
                                          num_unique=4)[0],
  }
  # The other combiners in one call (one route on a routed table).
  pooled = emb.lookup_requests(tuple(Request(_ids(4, 0), None, c) for c in ("sum", "sqrtn")))
  out["bag (4, 0) sum"], out["bag (4, 0) sqrtn"] = pooled

  def loss(m):
    return (m(_ids(4, 0)).sum() + m(_ids(0, 3)).sum()).astype(jnp.float32)

  out["grad"] = nnx.grad(loss)(emb).embedding[...]
  return out


# Shapes of each entry point's result; None: ``grad`` (the physical table's).
SHAPES = {
    "call (4, 0)": (4, 0, F),
    "call (0,)": (0, F),
    "call (0, 3)": (0, 3, F),
    "bag (0, 3)": (0, F),
    "bag (4, 0) sum": (4, F),
    "bag (4, 0) mean": (4, F),
    "bag (4, 0) sqrtn": (4, F),
    "attend (0, F)": (0, N),
    "dedup (4, 0)": (4, 0, F),
    "dedup (0, 3)": (0, F),
    "grad": None,
}


@pytest.fixture(scope="module")
def results():
  """Each case's module and results, built on first use and shared by the tests."""

  @functools.cache
  def run(case):
    emb = build(*case)
    return emb, _every_entry_point(emb)

  return run


@pytest.mark.parametrize("entry", list(SHAPES))
@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_entry_point_on_empty_ids(results, case, entry):
  emb, out = results(case)
  got = out[entry]
  if entry == "grad":
    assert got.shape == emb.embedding.shape
    assert got.dtype == emb.param_dtype
  else:
    assert got.shape == SHAPES[entry]
    assert got.dtype == DTYPE
  np.testing.assert_array_equal(np.asarray(got, np.float32), 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eager_call_on_the_issue_mesh(strategy):
  """The issue's call: eager, Explicit 8-device mesh, default kernel."""
  emb = build("8", strategy, "auto")
  out = emb(_ids(4, 0))
  assert out.shape == (4, 0, F) and out.dtype == DTYPE


def test_kernels_on_empty_ids():
  """The kernel entry points themselves, every kernel: typed empty results, zero gradient."""
  table = jnp.arange(1.0 * N * F).reshape(N, F)
  for kernel in KERNELS:
    assert embedlib.kernels.gather(table, _ids(4, 0), kernel=kernel).shape == (4, 0, F)
    pooled = embedlib.kernels.bag(table, _ids(3, 0), combiner="mean", kernel=kernel)
    assert pooled.shape == (3, F) and pooled.dtype == table.dtype
    np.testing.assert_array_equal(pooled, 0)
    grad = jax.grad(lambda t: embedlib.kernels.gather(t, _ids(0, 2), kernel=kernel).sum())(table)
    np.testing.assert_array_equal(grad, 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mesh_name", ["none", "8", "2x4-auto"])
def test_sparse_step_on_an_empty_batch_keeps_the_table(mesh_name, strategy):
  emb = build(mesh_name, strategy, "auto")
  opt = optim.SparseAwareOptimizer(emb, None, optim.RowWiseAdagrad(0.5))
  before = np.asarray(emb.logical_table())
  slots = jax.tree.map(np.asarray, opt.slots)

  @nnx.jit
  def step(emb, opt):
    def loss_fn(m):
      rows = m(_ids(4, 0)).sum() + m(_ids(0)).sum() + m.bag(_ids(0, 3)).sum()
      return (rows + m.bag(_ids(4, 0), combiner="mean").sum()).astype(jnp.float32)

    loss, grads = optim.value_and_grad(loss_fn)(emb)
    opt.update(emb, grads)
    return loss

  assert float(step(emb, opt)) == 0.0
  np.testing.assert_array_equal(np.asarray(emb.logical_table()), before)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, opt.slots), slots)
  assert int(opt.step[...]) == 1


TABLES = [embedlib.TableSpec(s, N, F, sharding=s) for s in STRATEGIES]
FEATURES = [embedlib.FeatureSpec("pooled", "vocab", combiner="mean"),
            embedlib.FeatureSpec("rows", "hidden", combiner=None),
            embedlib.FeatureSpec("single", "replicated", max_ids_per_sample=1),
            embedlib.FeatureSpec("routed", "routed", combiner="sqrtn"),
            embedlib.FeatureSpec("no_ids", "vocab")]


@pytest.mark.parametrize("mesh_name, num_unique",
                         [("none", None), ("8", None), ("8", 4), ("2x4-auto", None)])
def test_collection_empty_batch_and_empty_bag(mesh_name, num_unique):
  mesh, axes = _mesh(mesh_name)
  coll = embedlib.EmbeddingCollection(TABLES, FEATURES, mesh=mesh, num_unique=num_unique,
                                      rngs=nnx.Rngs(0), **axes)
  empty_batch = {"pooled": _ids(0, 3), "rows": _ids(0, 2), "single": _ids(0),
                 "routed": _ids(0, 2), "no_ids": _ids(0, 0)}
  ids = jnp.arange(8, dtype=jnp.int32).reshape(4, 2)
  empty_bag = {"pooled": ids, "rows": ids, "single": ids[:, 0], "routed": ids,
               "no_ids": _ids(4, 0)}
  empty, some = nnx.jit(lambda c: (c(empty_batch), c(empty_bag)))(coll)

  widths = {"rows": (2, F)}
  for name, out in empty.items():
    assert out.shape == (0,) + widths.get(name, (F,)) and out.dtype == jnp.float32, name
  for name, out in some.items():
    assert out.shape == (4,) + widths.get(name, (F,)) and out.dtype == jnp.float32, name
  np.testing.assert_array_equal(some["no_ids"], 0)
  table = np.asarray(coll.logical_table("hidden"))
  np.testing.assert_array_equal(some["rows"], table[np.asarray(ids)])


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_on_empty_local_ids_inside_shard_map(kernel):
  """A shard of no ids: each platform's branch types its result alike (the issue's TypeError)."""
  from embedlib import _compat
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((8,), ("batch",))
  kernels = embedlib.kernels

  def body(table, ids):
    rows = kernels.gather(table, ids, kernel=kernel)
    return rows, kernels.bag(table, ids, combiner="sqrtn", kernel=kernel)

  def loss(table, ids):
    rows, pooled = _compat.shard_map(
        body, mesh=mesh, in_specs=(P(), P("batch")), out_specs=(P("batch"), P("batch")),
        check_vma=kernels.shard_map_check_vma(kernel))(table, ids)
    return rows.sum() + pooled.sum(), (rows, pooled)

  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  table = put(jnp.ones((N, F), jnp.bfloat16), P())
  grad, (rows, pooled) = jax.jit(jax.grad(loss, has_aux=True))(table, put(_ids(8, 0), P("batch")))
  assert rows.shape == (8, 0, F) and rows.dtype == jnp.bfloat16
  assert pooled.shape == (8, F) and pooled.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(pooled, np.float32), 0)
  assert grad.shape == (N, F)
  np.testing.assert_array_equal(np.asarray(grad, np.float32), 0)


@pytest.mark.parametrize("strategy", ["vocab", "routed"])
def test_empty_bags_split_like_their_ids(strategy):
  """Zeros for split ids come back split the same way, as a lookup's rows do."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  emb = build("8", strategy, "auto")
  ids = jax.device_put(_ids(8, 0), NamedSharding(emb.mesh, P("batch")))
  out = emb.bag(ids)
  assert out.shape == (8, F) and out.dtype == DTYPE
  assert out.sharding.spec[0] == "batch"
