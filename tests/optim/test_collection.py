"""Sparse training of an ``EmbeddingCollection``: pooled bags, shared tables.

The collection reports each feature's lookup through the same row tap as
``ShardedEmbed`` (pooled features with each id's coefficient in its bag), so
per table the row gradients, summed per id, must equal the dense gradient
of its table, and one optimizer step must move exactly the touched rows.
With dedup (``num_unique``): the tap sits outside the collection's
``lax.cond``, on the path every lookup takes.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embedlib import EmbeddingCollection, FeatureSpec, TableSpec, optim

FEATURES = {
    "clicks": jnp.array([[1, 2, -1], [3, 3, -1], [2, 7, 9], [0, -1, -1]]),
    "last_item": jnp.array([5, 6, 1, 1]),
    "history": jnp.array([[1, 1], [2, 7], [4, 4], [0, 3]]),
    "country": jnp.array([0, 19, 3, 3]),
}


def scatter_rows(pairs, n, f):
  grad = np.zeros((n, f))
  for ids, g in pairs:
    ids, g = np.asarray(ids).reshape(-1), np.asarray(g).reshape(-1, f)
    ok = (ids >= 0) & (ids < n)
    np.add.at(grad, ids[ok], g[ok])
  return grad


def test_collection_row_gradients_and_step():
  mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
  coll = EmbeddingCollection(
      [TableSpec("item", 30, 6), TableSpec("country", 20, 4)],
      [FeatureSpec("clicks", "item", combiner="mean"),
       FeatureSpec("last_item", "item", max_ids_per_sample=1),
       FeatureSpec("history", "item", combiner=None),
       FeatureSpec("country", "country", combiner="sqrtn")],
      mesh=mesh, num_unique=8, replicate_below_bytes=0, rngs=nnx.Rngs(0))
  def loss_fn(c):
    return sum(jnp.sum(jnp.sin(o)) + jnp.sum(o**2) for o in c(FEATURES).values())

  dense = nnx.jit(nnx.grad(loss_fn))(coll)
  _, grads = nnx.jit(optim.value_and_grad(loss_fn))(coll)
  assert set(grads.rows) == {"tables/item", "tables/country"}
  for name in ("item", "country"):
    table = coll.tables[name]
    n, f = table.num_embeddings, table.features
    want = np.asarray(dense["tables"][name]["embedding"][...])[:n, :f]
    got = scatter_rows(grads.rows[f"tables/{name}"], n, f)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)

  opt = optim.SparseAwareOptimizer(coll, None, optim.SparseSGD(0.1))
  before = np.array(coll.tables["item"].logical_table())

  @nnx.jit
  def step(coll, opt):
    _, grads = optim.value_and_grad(loss_fn)(coll)
    opt.update(coll, grads)

  step(coll, opt)
  after = np.array(coll.tables["item"].logical_table())
  touched = np.zeros(30, bool)
  touched[[1, 2, 3, 7, 9, 0, 5, 6, 4]] = True
  want = np.asarray(dense["tables"]["item"]["embedding"][...])[:30, :6]
  np.testing.assert_allclose(after[touched], before[touched] - 0.1 * want[touched], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(after[~touched], before[~touched])


def test_grid_table_in_a_collection_trains_like_its_dense_gradient():
  """A grid table (rows over "model", columns over "data"), pooled and sequence features."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  coll = EmbeddingCollection(
      [TableSpec("item", 30, 6, sharding="grid", column_axes="data"),
       TableSpec("country", 20, 4)],
      [FeatureSpec("clicks", "item", combiner="mean"),
       FeatureSpec("history", "item", combiner=None),
       FeatureSpec("last_item", "item", max_ids_per_sample=1),
       FeatureSpec("country", "country", combiner="sqrtn")],
      mesh=mesh, rngs=nnx.Rngs(0))
  table = coll.tables["item"]
  assert table.plan.strategy == "grid" and table.plan.column_axes == ("data",)
  assert table.plan.shard_shape == (8, 3)

  def loss_fn(c):
    return sum(jnp.sum(jnp.sin(o)) + jnp.sum(o**2) for o in c(FEATURES).values())

  dense = nnx.jit(nnx.grad(loss_fn))(coll)
  want = np.asarray(dense["tables"]["item"]["embedding"][...])[:30, :6]
  opt = optim.SparseAwareOptimizer(coll, None, optim.RowWiseAdagrad(0.1, eps=1e-3))
  before = np.array(table.logical_table())

  @nnx.jit
  def step(coll, opt):
    _, grads = optim.value_and_grad(loss_fn)(coll)
    opt.update(coll, grads)
    return grads

  grads = step(coll, opt)
  np.testing.assert_allclose(scatter_rows(grads.rows["tables/item"], 30, 6), want,
                             rtol=1e-5, atol=1e-6)
  touched = np.zeros(30, bool)
  touched[[1, 2, 3, 7, 9, 0, 5, 6, 4]] = True
  acc = np.mean(want**2, axis=1)   # over the whole row, not a rank's columns
  expect = before - 0.1 * want / (np.sqrt(acc)[:, None] + 1e-3)
  after = np.array(table.logical_table())
  np.testing.assert_allclose(after[touched], expect[touched], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(after[~touched], before[~touched])
  slots = opt.slots[opt.keys.index("tables/item")]
  np.testing.assert_allclose(np.asarray(slots["acc"][...])[:30][touched], acc[touched],
                             rtol=1e-5)
