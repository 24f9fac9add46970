"""EmbeddingCollection against the unsharded reference: meshes x dedup x features.

One small collection covers every feature form at once (each combiner,
weights, padding and invalid ids, ragged input, single-hot, sequence, shared
tables, mixed and non-dividing widths, all four strategies); the tests run
it over the product of meshes and dedup modes. Tolerance: f32 sums of at
most 8 rows computed in another order, so 1e-5 relative.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

from embedlib import EmbeddingCollection, FeatureSpec, TableSpec
from embedlib.collection import Ragged
from tests.collection import check, reference

TABLES = (
    TableSpec("items", 50, 8, sharding="vocab"),
    TableSpec("users", 37, 12, sharding="hidden"),  # 12 columns pad on 8 ranks
    TableSpec("small", 9, 4, sharding="replicated"),
    TableSpec("tags", 45, 8, sharding="routed"),
)
FEATURES = (
    FeatureSpec("clicks", "items"),  # sum, padded bags
    FeatureSpec("views", "items", combiner="mean"),  # weighted, shares "items"
    FeatureSpec("bio", "users", combiner="sqrtn", max_ids_per_sample=4),  # ragged
    FeatureSpec("user", "users", combiner=None, max_ids_per_sample=1),  # single-hot row
    FeatureSpec("history", "users", combiner=None),  # sequence
    FeatureSpec("country", "small", max_ids_per_sample=1),  # weighted single-hot sum
    FeatureSpec("tags", "tags", combiner="mean"),  # weighted, routed with "tag_seq"
    FeatureSpec("tag_seq", "tags", combiner=None),
)
BATCH = 6  # divides neither 4 nor 8: batch padding on every sharded mesh


def make_inputs(seed=0):
  """Ids with duplicates, -1 padding, empty bags and ids past the table."""
  rng = np.random.default_rng(seed)
  ids = lambda n, shape: rng.integers(-1, n + 2, shape)
  clicks = ids(50, (BATCH, 5))
  clicks[0] = -1  # an empty bag
  lengths = np.array([0, 4, 1, 2, 3, 4])
  inputs = {
      "clicks": clicks,
      "views": ids(50, (BATCH, 3)),
      "bio": (ids(37, (int(lengths.sum()) + 2,)), lengths),  # capacity > used
      "user": ids(37, (BATCH,)),
      "history": ids(37, (BATCH, 3)),
      "country": ids(9, (BATCH,)),
      "tags": ids(45, (BATCH, 4)),
      "tag_seq": ids(45, (BATCH, 2)),
  }
  weights = {
      "views": rng.uniform(0.5, 2.0, (BATCH, 3)).astype(np.float32),
      "bio": rng.uniform(0.5, 2.0, (int(lengths.sum()) + 2,)).astype(np.float32),
      "country": rng.uniform(0.5, 2.0, (BATCH,)).astype(np.float32),
      "tags": rng.uniform(0.5, 2.0, (BATCH, 4)).astype(np.float32),
  }
  return inputs, weights


def as_jax(inputs, weights):
  conv = lambda x: Ragged(*map(jnp.asarray, x)) if isinstance(x, tuple) else jnp.asarray(x)
  return {k: conv(v) for k, v in inputs.items()}, {k: jnp.asarray(v) for k, v in weights.items()}


MESHES = {
    "none": lambda: (None, {}),
    "1": lambda: (jax.make_mesh((1,), ("batch",), devices=jax.devices()[:1]), {}),
    "2": lambda: (jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2]), {}),
    "4": lambda: (jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4]), {}),
    "8": lambda: (jax.make_mesh((8,), ("batch",)), {}),
    # Tensor-parallel: ids replicated over "model", tables split over it.
    "2x4": lambda: (jax.make_mesh((2, 4), ("data", "model")), {}),
    # Tables over both axes: token ranks ("data") and rest ranks ("model").
    "4x2_all": lambda: (
        jax.make_mesh((4, 2), ("data", "model")),
        {"table_axes": ("data", "model")},
    ),
}
# None: no dedup; 64 fits every shard; 2 overflows, so the fallback must run.
DEDUP = {"off": None, "fits": 64, "overflow": 2}


def build(mesh_name, dedup, **kw):
  mesh, extra = MESHES[mesh_name]()
  return EmbeddingCollection(
      TABLES, FEATURES, mesh=mesh, num_unique=DEDUP[dedup], rngs=nnx.Rngs(0),
      **extra, **kw,
  )


def logical_tables(coll):
  return {name: jnp.asarray(np.asarray(coll.tables[name].logical_table())) for name in coll.tables}


def assert_outputs_close(got, want):
  assert sorted(got) == sorted(f.name for f in FEATURES)  # jit sorts dict keys
  for name in want:
    assert got[name].shape == want[name].shape, name
    np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]),
                               rtol=1e-5, atol=1e-6, err_msg=name)


def apply(coll, x, w):
  """Pure-function form of ``coll(x, w)``, for jit / grad / checkify."""
  graphdef, state = nnx.split(coll)
  return lambda state, x, w: nnx.merge(graphdef, state)(x, w), state


# Every mesh without dedup; dedup that fits on the meshes whose layouts differ
# (one device, token-sharded, token + rest ranks); the overflow fallback on a
# token-sharded mesh. Each case checks the outputs and the gradients of every
# table in one compile.
CASES = (
    [(m, "off") for m in MESHES]
    + [(m, "fits") for m in ("none", "8", "4x2_all")]
    + [(m, "overflow") for m in ("4",)]
)
# CI runs each family of meshes (none, batch-only, 2x4, 4x2_all) once and
# each dedup mode on a batch-only mesh: no dedup on 8 (which pads the batch
# and the 12 columns) and on 2x4; dedup that fits without a mesh, on 8 and
# on 4x2_all; the overflow on 4. ``-m slow`` adds no dedup on none, 1, 2, 4
# and 4x2_all.
CI = {("none", "fits"), ("8", "off"), ("8", "fits"), ("4", "overflow"), ("2x4", "off"),
      ("4x2_all", "fits")}


@pytest.mark.parametrize("mesh_name,dedup", [
    pytest.param(m, d, id=f"{m}-{d}", marks=() if (m, d) in CI else pytest.mark.slow)
    for m, d in CASES
])
def test_outputs_and_gradients_match_reference(mesh_name, dedup):
  coll = build(mesh_name, dedup)
  inputs, weights = make_inputs()
  x, w = as_jax(inputs, weights)
  got, grads, want, want_grads = check.outputs_and_gradients(
      coll, lambda m: m(x, w), logical_tables(coll), FEATURES, inputs, weights, seed=2)
  assert_outputs_close(got, want)
  for spec in TABLES:
    g = np.asarray(grads["tables"][spec.name]["embedding"][...])
    n, f = spec.num_embeddings, spec.features
    np.testing.assert_allclose(g[:n, :f], np.asarray(want_grads[spec.name]), rtol=1e-5,
                               atol=1e-6, err_msg=spec.name)
    assert np.abs(want_grads[spec.name]).sum() > 0, spec.name  # the test can fail
    assert not g[n:].any() and not g[:, f:].any(), f"{spec.name}: padding got a gradient"


def test_eager_call_on_explicit_mesh_with_nnx_grad():
  """No jit: an eager lookup and ``nnx.grad`` inside ``jax.set_mesh``."""
  mesh = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
  feats = (FeatureSpec("a", "items", combiner="mean"),)
  coll = EmbeddingCollection(TABLES[:1], feats, mesh=mesh, rngs=nnx.Rngs(1))
  x = {"a": jnp.array([[1, 2, -1], [3, 3, 49]])}
  t = np.asarray(coll.tables["items"].logical_table())
  with jax.set_mesh(mesh):
    out = coll(x)["a"]
    g = nnx.grad(lambda m: m(x)["a"][:, 0].sum())(coll)
  np.testing.assert_allclose(out, np.stack([(t[1] + t[2]) / 2, (2 * t[3] + t[49]) / 3]), rtol=1e-5)
  g = np.asarray(g["tables"]["items"]["embedding"][...])
  assert g[3, 0] == pytest.approx(2 / 3) and g[1, 0] == pytest.approx(0.5)
  assert not g[:, 1:].any() and not g[4].any()


@pytest.mark.parametrize("mesh_name", ["none", "4x2_all"])
def test_pallas_kernel_matches_reference(mesh_name):
  """The interpreted Pallas kernels, dedup on (both paths are traced)."""
  coll = build(mesh_name, "fits", kernel="pallas")
  inputs, weights = make_inputs(seed=3)
  x, w = as_jax(inputs, weights)
  fn, state = apply(coll, x, w)
  got = jax.jit(fn)(state, x, w)
  assert_outputs_close(got, check.reference_outputs(logical_tables(coll), FEATURES, inputs,
                                                    weights))


def test_unique_counts_size_the_capacity():
  coll = build("2", "off")
  inputs, weights = make_inputs()
  counts = coll.unique_counts(as_jax(inputs, weights)[0])
  shard = lambda name: np.asarray(inputs[name])[: BATCH // 2]
  items = np.concatenate([shard("clicks"), shard("views")], axis=1)
  first = len({int(i) for i in items.ravel() if 0 <= i < 50})
  items = np.concatenate([np.asarray(inputs["clicks"])[BATCH // 2:],
                          np.asarray(inputs["views"])[BATCH // 2:]], axis=1)
  second = len({int(i) for i in items.ravel() if 0 <= i < 50})
  assert counts["items"] == max(first, second)
  assert set(counts) == {"items", "users", "small", "tags"}


def test_overflow_error_names_table_and_capacity():
  mesh = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
  make = lambda cap: EmbeddingCollection(
      TABLES[:1], FEATURES[:2], mesh=mesh, num_unique=cap, on_overflow="error",
      rngs=nnx.Rngs(0))
  inputs, weights = make_inputs()
  x, w = as_jax({k: inputs[k] for k in ("clicks", "views")}, {"views": weights["views"]})
  coll = make(2)
  need = coll.unique_counts(x)["items"]
  assert need > 2
  with pytest.raises(ValueError, match=rf"table 'items'.*{need} distinct ids.*num_unique=2.*'items': {need}"):
    coll(x, w)
  # Under jit the check goes through checkify.
  fn, state = apply(coll, x, w)
  err, _ = checkify.checkify(jax.jit(fn))(state, x, w)
  with pytest.raises(checkify.JaxRuntimeError, match="table 'items'"):
    err.throw()
  # The exact capacity raises nothing.
  fn, state = apply(make(need), x, w)
  err, _ = checkify.checkify(jax.jit(fn))(state, x, w)
  err.throw()


def test_tables_are_sharded_params_like_sharded_embed():
  coll = build("8", "off")
  assert [t.name for t in coll.plan.tables] == ["items", "users", "small", "tags"]
  users = coll.tables["users"].embedding
  assert isinstance(users, nnx.Param)
  assert users.shape == (37, 12)  # logical, as nnx.Embed's
  assert coll.tables["users"].physical_table().shape == (37, 16)  # 12 columns padded to 8 ranks
  assert coll.plan["users"].plan.strategy == "hidden"
  params = nnx.state(coll, nnx.Param)
  assert len(jax.tree.leaves(params)) == len(TABLES)


def test_sparse_optimizer_row_gradients_match_dense_gradients():
  """``embedlib.optim`` sees every feature's lookup (pooled with coefficients)."""
  optim = pytest.importorskip("embedlib.optim")
  mesh = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
  feats = FEATURES[:5]  # items (pooled x2) and users (ragged, single-hot, sequence)
  coll = EmbeddingCollection(TABLES[:2], feats, mesh=mesh, num_unique={"users": 16},
                             rngs=nnx.Rngs(0))
  inputs, weights = make_inputs()
  x, w = as_jax({f.name: inputs[f.name] for f in feats},
                {k: v for k, v in weights.items() if k in ("views", "bio")})
  loss = lambda m: sum(jnp.sum(jnp.sin(v)) for v in m(x, w).values())
  rows = nnx.jit(lambda m: optim.value_and_grad(loss)(m)[1].rows)(coll)
  dense = jax.jit(nnx.grad(loss))(coll)
  for spec in TABLES[:2]:
    (key,) = [k for k in rows if k.split("/")[-1] == spec.name]
    acc = np.zeros(coll.tables[spec.name].embedding.shape, np.float32)  # logical, as the gradient
    for ids, grads in rows[key]:
      ids = np.asarray(ids).reshape(-1)
      grads = np.asarray(grads).reshape(ids.shape[0], -1)
      keep = ids >= 0
      np.add.at(acc[:, : grads.shape[1]], ids[keep], grads[keep])
    want = np.asarray(dense["tables"][spec.name]["embedding"][...])
    np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-6, err_msg=spec.name)


@pytest.mark.parametrize("dedup", ["fits", "overflow"])
def test_dedup_features_split_differently(dedup):
  """Features of one table whose ids arrive split differently, dedup on.

  On Explicit axes each output takes its own ids' batch split. The dedup path
  gave every output the first feature's split, so its ``lax.cond`` with the
  fallback failed to trace (branches of different types) when a feature's
  ids were already split over the data axes and another's weren't (found by
  tests/test_properties.py).
  """
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
  feats = (FeatureSpec("clicks", "items"), FeatureSpec("views", "items", combiner=None))
  coll = EmbeddingCollection(TABLES[:1], feats, mesh=mesh, num_unique=DEDUP[dedup],
                             rngs=nnx.Rngs(0))
  rng = np.random.default_rng(4)
  inputs = {"clicks": rng.integers(-1, 52, (8, 3)), "views": rng.integers(-1, 52, (8, 2))}
  x = {"clicks": inputs["clicks"],
       "views": jax.device_put(inputs["views"], NamedSharding(mesh, P("batch")))}
  got = coll(x)
  want = reference.collection(logical_tables(coll), feats, inputs, {})
  for name in want:
    np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=1e-5,
                               atol=1e-6, err_msg=name)
  assert got["clicks"].sharding.spec[0] is None
  assert got["views"].sharding.spec[0] == "batch"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_ragged_input_split_over_the_mesh(jit):
  """Ragged values, lengths and weights already split over Explicit data axes.

  Bag offsets are a cumsum over the whole batch, which JAX refuses on an
  array split over Explicit axes (a raw ShardingTypeError before; found by
  tests/test_properties.py): the collection gathers them first.
  """
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
  feats = (FeatureSpec("bio", "users", combiner="mean", max_ids_per_sample=3),)
  coll = EmbeddingCollection(TABLES[1:2], feats, mesh=mesh, rngs=nnx.Rngs(0))
  values = np.array([3, 36, 5, 40, -1, 7, 7, 0])  # 40 and -1: padding
  lengths = np.array([1, 2, 0, 1, 1, 0, 3, 0])
  weights = np.linspace(0.5, 2.0, 8).astype(np.float32)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("batch")))
  x, w = {"bio": Ragged(put(values), put(lengths))}, {"bio": put(weights)}
  if jit:
    fn, state = apply(coll, x, w)
    got = jax.jit(fn)(state, x, w)
  else:
    got = coll(x, w)
  want = reference.collection(logical_tables(coll), feats, {"bio": (values, lengths)},
                              {"bio": weights})
  np.testing.assert_allclose(np.asarray(got["bio"]), np.asarray(want["bio"]), rtol=1e-5,
                             atol=1e-6)


def test_overflow_error_under_jit_with_several_tables():
  """``on_overflow="error"`` under jit + checkify in a collection of several tables.

  JAX's checkify can't carry a check past a later ``shard_map``: each
  table's capacity check used to follow its own lookup, so the next table's
  lookup broke tracing (a raw ``TypeError: select cases must have the same
  shapes``; found by tests/test_properties.py). The checks now run after
  every table's lookups.
  """
  mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
  feats = (FeatureSpec("clicks", "items"), FeatureSpec("history", "users", combiner=None))
  coll = EmbeddingCollection(TABLES[:2], feats, mesh=mesh, num_unique=3,
                             on_overflow="error", rngs=nnx.Rngs(0))
  ok = {"clicks": jnp.array([[1, 2, 2]] * 8), "history": jnp.array([[3, -1]] * 8)}
  over = {"clicks": jnp.arange(24).reshape(8, 3), "history": ok["history"]}
  fn, state = apply(coll, ok, {})
  checked = checkify.checkify(jax.jit(fn))
  err, out = checked(state, ok, {})
  assert jax.device_get(err).get() is None
  want = reference.collection(logical_tables(coll), feats, ok, {})
  for name in want:
    np.testing.assert_allclose(np.asarray(out[name]), np.asarray(want[name]), rtol=1e-5,
                               atol=1e-6, err_msg=name)
  err, _ = checked(state, over, {})
  assert "table 'items'" in jax.device_get(err).get()
  with pytest.raises(ValueError, match="table 'items'"):
    coll(over)


@pytest.mark.parametrize("split", [False, True], ids=["replicated", "split"])
def test_empty_ragged_batch_on_an_explicit_mesh(split):
  """An empty ragged batch whose arrays live on an Explicit mesh pools to nothing.

  Converting it to bags gathered values at an empty set of offsets, which
  JAX fails eagerly on an Explicit mesh; the collection passed that raw
  error off as the feature's own (found by tests/test_properties.py).
  """
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((8,), ("batch",))
  feats = (FeatureSpec("bio", "users", combiner="sqrtn", max_ids_per_sample=3),
           FeatureSpec("user", "users", combiner=None, max_ids_per_sample=1))
  coll = EmbeddingCollection(TABLES[1:2], feats, mesh=mesh, rngs=nnx.Rngs(0))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  lengths = put(np.zeros((0,), np.int32), P("batch") if split else P())
  values, weights = put(np.array([4, 5]), P()), put(np.ones(2, np.float32), P())
  out = coll({"bio": (values, lengths), "user": put(np.zeros((0,), np.int32), P())},
             {"bio": weights})
  assert out["bio"].shape == (0, 12) and out["user"].shape == (0, 12)
