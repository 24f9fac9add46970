"""Ids of every integer dtype, x64 on and off, at every public entry point.

An id is valid when ``0 <= id < num_embeddings`` as a mathematical integer,
whatever its dtype: int8 ids of a 40,000-row table are all in range once
non-negative, and a 64-bit id past int32's range is invalid (a zero row, no
update), never the row its low 32 bits name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import invalid_ids, optim
from embedlib.plan import plan_embedding
from tests.embed.contract import make_mesh

ROWS = 40_000
DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
X64 = pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])


def _ids(dtype):
  """Edge ids representable in ``dtype``: its extremes, the table's bounds, 2**32 + 5."""
  info = np.iinfo(dtype)
  values = [0, 1, 100, 200, 30_000, ROWS - 1, ROWS, 2**32 + 5, 2**63 + 3, -1, -3, info.min,
            info.max]
  return np.array([v for v in values if info.min <= v <= info.max], dtype)


def _expected(table, ids):
  """Reference rows, the range test done on Python ints."""
  out = np.zeros(ids.shape + table.shape[1:], table.dtype)
  for pos, v in np.ndenumerate(ids):
    if 0 <= int(v) < table.shape[0]:
      out[pos] = table[int(v)]
  return out


@X64
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sanitize_and_check_every_dtype(dtype, x64):
  ids = _ids(dtype)
  valid = np.array([0 <= int(v) < ROWS for v in ids])
  with jax.enable_x64(x64):
    got = invalid_ids.sanitize(invalid_ids.as_ids(ids, ROWS), ROWS)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.where(valid, ids.astype(np.int64), -1))
    if not valid.all():
      with pytest.raises(IndexError, match=f"outside \\[0, {ROWS}\\)"):
        invalid_ids.check(ids, ROWS, "t")
    invalid_ids.check(ids[valid], ROWS, "t")


@pytest.fixture(scope="module")
def vocab_embed():
  mesh = make_mesh((4,), ("model",))
  return embedlib.ShardedEmbed(ROWS, 4, mesh=mesh, sharding="vocab", rngs=nnx.Rngs(0))


@X64
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sharded_embed_every_dtype(vocab_embed, dtype, x64):
  ids = _ids(dtype)
  table = np.asarray(vocab_embed.logical_table())
  with jax.enable_x64(x64):
    np.testing.assert_array_equal(np.asarray(vocab_embed(ids)), _expected(table, ids))
    # As a JAX array of the same dtype (64-bit ones exist only with x64 on).
    if x64 or np.dtype(dtype).itemsize < 8:
      traced = nnx.jit(lambda m, i: m(i))(vocab_embed, jnp.asarray(ids))
      np.testing.assert_array_equal(np.asarray(traced), _expected(table, ids))


@pytest.mark.parametrize("strategy", ["replicated", "hidden"])
@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int64], ids=lambda d: np.dtype(d).name)
def test_other_layouts_narrow_and_wide_ids(strategy, dtype):
  mesh = make_mesh((2,), ("model",))
  emb = embedlib.ShardedEmbed(ROWS, 4, mesh=mesh, sharding=strategy,
                              replicate_below_bytes=0, rngs=nnx.Rngs(1))
  ids = _ids(dtype)
  np.testing.assert_array_equal(
      np.asarray(emb(ids)), _expected(np.asarray(emb.logical_table()), ids))


def test_error_mode_rejects_wide_ids_on_the_host():
  emb = embedlib.ShardedEmbed(ROWS, 2, invalid_ids="error", rngs=nnx.Rngs(0))
  with pytest.raises(IndexError, match="id 4294967301"):
    emb(np.array([3, 2**32 + 5], np.int64))
  with pytest.raises(IndexError, match="id 9223372036854775811"):
    emb(np.array([2**63 + 3], np.uint64))
  assert emb(np.array([ROWS - 1], np.uint64)).shape == (1, 2)


@pytest.fixture(scope="module")
def collection():
  """One collection for every dtype: its eager calls reuse one executable per input form."""
  return embedlib.EmbeddingCollection(
      [embedlib.TableSpec("t", ROWS, 2)],
      [embedlib.FeatureSpec("bag", "t", combiner="sum"),
       embedlib.FeatureSpec("one", "t", max_ids_per_sample=1),
       embedlib.FeatureSpec("seq", "t", combiner=None),
       embedlib.FeatureSpec("ragged", "t", max_ids_per_sample=3)],
      rngs=nnx.Rngs(0))


@X64
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_collection_every_dtype(collection, dtype, x64):
  coll = collection
  table = np.asarray(coll.tables["t"].logical_table())
  # Every dtype's edge ids, repeated to one length (13, the most any dtype
  # has is 12): the cases then share the collection's executables, one per
  # input form, instead of compiling their own for each count of ids.
  ids = np.resize(_ids(dtype), 13)
  bags = np.resize(ids, (len(ids), 2))
  lengths = np.array([2, 0, 3] + [1] * (len(ids) - 5) + [0, 0])  # sums to len(ids)
  with jax.enable_x64(x64):
    out = coll({"bag": bags, "one": ids, "seq": bags, "ragged": (ids, lengths)})
  rows = _expected(table, bags)
  np.testing.assert_allclose(np.asarray(out["bag"]), rows.sum(1), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(out["one"]), _expected(table, ids))
  np.testing.assert_array_equal(np.asarray(out["seq"]), rows)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  ragged = [_expected(table, ids[s:s + n]).sum(0) for s, n in zip(starts, lengths)]
  np.testing.assert_allclose(np.asarray(out["ragged"]), np.stack(ragged), rtol=1e-6)


@X64
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_row_gradients_every_dtype(dtype, x64):
  plan = plan_embedding(ROWS, 1)
  ids = _ids(dtype)
  grads = np.ones(ids.shape + (1,), np.float32)
  with jax.enable_x64(x64):
    table, _ = optim.apply_row_grads(
        optim.SparseSGD(1.0), jnp.zeros((ROWS, 1)), {}, [(ids, grads)],
        plan=plan, mesh=None, step=0)
  expected = np.zeros((ROWS, 1), np.float32)
  for v in ids:
    if 0 <= int(v) < ROWS:
      expected[int(v)] -= 1.0
  np.testing.assert_array_equal(np.asarray(table), expected)
