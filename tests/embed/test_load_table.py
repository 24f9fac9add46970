"""``load_table``: host and device tables placed shard by shard, bad tables named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import embedlib
from tests.embed.contract import make_mesh

# The grid: rows over "model" (99 -> 100), columns over "data" (9 -> 10).
LAYOUTS = [("vocab", 99, 12), ("hidden", 50, 10), ("replicated", 20, 6), ("grid", 99, 9)]


class Recording(np.ndarray):
  """A host array that records every block read from it (as np.memmap is read)."""

  def __getitem__(self, index):
    self.reads.append(index)
    return np.asarray(super().__getitem__(index))


def _recording(values):
  out = np.asarray(values).view(Recording)
  out.reads = []
  return out


def _emb(sharding, rows, cols, **kwargs):
  mesh = make_mesh((2, 4), ("data", "model"))
  return embedlib.ShardedEmbed(rows, cols, mesh=mesh, sharding=sharding, name="item",
                               rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("sharding, rows, cols", LAYOUTS)
def test_host_table_is_read_one_shard_at_a_time(sharding, rows, cols):
  emb = _emb(sharding, rows, cols)
  values = np.arange(rows * cols, dtype=np.float64).reshape(rows, cols)
  host = _recording(values)
  emb.load_table(host)
  physical = np.asarray(emb.physical_table())
  np.testing.assert_array_equal(physical[:rows, :cols], values.astype(np.float32))
  assert not physical[rows:].any() and not physical[:, cols:].any()
  assert emb.physical_table().sharding.is_equivalent_to(emb._sharding(), 2)
  assert emb.physical_table().dtype == jnp.float32
  blocks = {tuple((s.start, s.stop) for s in index) for index in host.reads}
  if sharding == "replicated":
    assert blocks == {((0, rows), (0, cols))}
  elif sharding == "grid":
    # One read per device: a quarter of the rows and half the columns.
    assert len(blocks) == 8
    for (r0, r1), (c0, c1) in blocks:
      assert r1 - r0 <= -(-rows // 4) and c1 - c0 <= -(-cols // 2)
  else:
    # One read per shard of the 4-way group, each at most a shard's rows
    # (vocab) or columns (hidden), padding cut off.
    assert len(blocks) == 4
    most = (-(-rows // 4), cols) if sharding == "vocab" else (rows, -(-cols // 4))
    for (r0, r1), (c0, c1) in blocks:
      assert r1 - r0 <= most[0] and c1 - c0 <= most[1]


def test_memmap_and_device_tables(tmp_path):
  emb = _emb("vocab", 99, 12)
  values = np.random.default_rng(0).normal(size=(99, 12)).astype(np.float32)
  path = tmp_path / "table.f32"
  values.tofile(path)
  emb.load_table(np.memmap(path, np.float32, "r", shape=(99, 12)))
  np.testing.assert_array_equal(np.asarray(emb.logical_table()), values)
  emb.load_table(jnp.asarray(values * 2))
  np.testing.assert_array_equal(np.asarray(emb.logical_table()), values * 2)
  emb.load_table((values * 3).tolist())
  np.testing.assert_array_equal(np.asarray(emb.logical_table()), values * 3)


def test_loaded_table_is_looked_up():
  emb = _emb("hidden", 50, 10)
  values = np.arange(500, dtype=np.int64).reshape(50, 10)  # ints are cast
  emb.load_table(values)
  ids = jnp.array([[0, 49], [7, 3]])
  np.testing.assert_array_equal(np.asarray(emb(ids)), values[np.asarray(ids)].astype(np.float32))


@pytest.mark.parametrize("table, pattern", [
    (np.zeros((99, 13)), r"item: load_table got a table of shape \(99, 13\), expected the logical shape \(99, 12\)"),
    (np.zeros((100, 12)), r"shape \(100, 12\).*without padding"),
    (np.zeros((99, 12), np.complex64), r"item: load_table got a complex table \(complex64\).*table\.real"),
    (np.full((99, 12), "a"), r"item: load_table got a table of dtype <U1, which is not numeric"),
    (np.full((99, 12), None, dtype=object), r"dtype object, which is not numeric"),
])
def test_bad_tables_are_named(table, pattern):
  emb = _emb("vocab", 99, 12)
  before = np.asarray(emb.embedding[...])
  with pytest.raises(ValueError, match=pattern):
    emb.load_table(table)
  np.testing.assert_array_equal(np.asarray(emb.embedding[...]), before)


def test_values_that_overflow_the_param_dtype_are_named():
  emb = _emb("vocab", 99, 12)
  table = np.ones((99, 12))
  table[41, 3] = 1e39  # finite in float64, inf in float32
  with pytest.raises(ValueError, match=r"item: load_table got float64 values as large as "
                                       r"1e\+39 \(row 41\).*float32.*to inf"):
    emb.load_table(table)
  small = _emb("vocab", 99, 12, param_dtype=jnp.float16)
  with pytest.raises(ValueError, match=r"int64 values as large as 70000 \(row 98\).*float16"):
    small.load_table(np.where(np.arange(99)[:, None] == 98, 70_000, 1) * np.ones((99, 12), np.int64))
  table[41, 3] = np.inf  # already inf: loaded as it is
  emb.load_table(table)
  assert np.isinf(np.asarray(emb.logical_table())[41, 3])


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_bfloat16_overflow_is_named_for_host_and_device_tables(on_device):
  emb = _emb("hidden", 50, 10, param_dtype=jnp.bfloat16)
  table = np.ones((50, 10), np.float32)
  table[7, 2] = 3.4e38  # finite in float32, past bfloat16's largest
  if on_device:  # split as a caller's array may be
    table = jax.device_put(table, NamedSharding(emb.mesh, P("data", None)))
  with pytest.raises(ValueError, match=r"float32 values as large as 3\.4e\+38 \(row 7\).*bfloat16"):
    emb.load_table(table)
  emb.load_table(table.clip(-1e38, 1e38))
  assert np.asarray(emb.logical_table(), np.float32)[7, 2] == np.float32(jnp.bfloat16(1e38))
