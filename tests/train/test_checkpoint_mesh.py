"""A checkpoint saved on 8 devices restores onto 4, 3 and 1 device, shard by shard.

And a grid table's (rows and columns split at once) onto the 1-D layouts
and a grid on another mesh, and theirs onto a grid.

Checkpoints hold logical (unpadded) tables and slots, so a new mesh with new
padding gets identical tables and single-hot lookups, and the same next
step; they are written and read one shard at a time, so no device holds a
whole table. Tolerances: pooled bags add their rows' partial sums across ranks in
a mesh-dependent order (1e-6 relative), and so does the all-reduce of the
dense gradients, which the next-step loss sees (1e-5).
"""

import logging
import urllib.parse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from flax import nnx
from jax.sharding import AxisType

import embedlib
from configs import quickstart
from embedlib import checkpoint, optim
from embedlib.checkpoint import sharded
from embedlib import data as data_lib
from embedlib.training import setup, train_lib
from embedlib.training.tasks import CTRTask

CTR = CTRTask()  # the quickstart's click model


def _mesh(n):
  return jax.make_mesh((n,), ("batch",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


@pytest.fixture(scope="module")
def config():
  config = quickstart.get_config("smoke")
  with config.unlocked():
    config.batch_size = 24  # divides 8, 4, 3 and 1 devices
  return config


# Jitted: eager, each lookup dispatches its ops one by one (about 17 s here).
_lookups = nnx.jit(lambda embeddings, sparse: embeddings(sparse))


def _state(config, mesh):
  task = setup.task(config)
  spec = task.data_spec()
  model, optimizer = setup.model_and_optimizer(config, task, spec, mesh)
  source, _ = setup.sources(config, task, spec)
  return model, optimizer, source


@pytest.fixture(scope="module")
def saved8(config, tmp_path_factory):
  """A run saved on 8 devices at step 2, then its next batch's tables, lookups and loss."""
  mesh8 = _mesh(8)
  model, optimizer, source = _state(config, mesh8)
  for _ in range(2):
    train_lib.train_step(model, optimizer, data_lib.to_global_batch(next(source), mesh8), task=CTR)
  path = str(tmp_path_factory.mktemp("ckpt8"))
  ckpt = checkpoint.Checkpointer(path, asynchronous=False)
  ckpt.save(2, model, optimizer, source.get_state())
  ckpt.wait()
  ckpt.close()
  batch = next(source)
  tables8 = {k: np.asarray(t.logical_table()) for k, t in model.embeddings.tables.items()}
  lookups8 = {k: np.asarray(v) for k, v in
              _lookups(model.embeddings, data_lib.to_global_batch(batch, mesh8)["sparse"]).items()}
  loss8 = float(train_lib.train_step(model, optimizer, data_lib.to_global_batch(batch, mesh8),
                                     task=CTR))
  return path, tables8, lookups8, loss8


# 3 devices: padding that differs from 8's on every table; 1: none at all. 4 divides 8
# (the next test restores onto 4 too).
@pytest.mark.parametrize("n", [3, 1, pytest.param(4, marks=pytest.mark.slow)])
def test_restore_on_fewer_devices_gives_identical_lookups_and_next_step(config, saved8, n):
  path, tables8, lookups8, loss8 = saved8
  ckpt = checkpoint.Checkpointer(path, asynchronous=False)
  mesh = _mesh(n)
  model_n, optimizer_n, source_n = _state(config, mesh)
  source_n.set_state(ckpt.restore(model_n, optimizer_n))
  ckpt.close()
  assert source_n.position == 2
  for k, t in model_n.embeddings.tables.items():
    np.testing.assert_array_equal(np.asarray(t.logical_table()), tables8[k])
  global_batch = data_lib.to_global_batch(next(source_n), mesh)
  for k, v in _lookups(model_n.embeddings, global_batch["sparse"]).items():
    if global_batch["sparse"][k].ndim == 1:  # single-hot: bit-identical
      np.testing.assert_array_equal(np.asarray(v), lookups8[k])
    else:  # pooled bags sum partial rows in a mesh-dependent order
      np.testing.assert_allclose(np.asarray(v), lookups8[k], rtol=1e-6, atol=1e-7)
  loss = float(train_lib.train_step(model_n, optimizer_n, global_batch, task=CTR))
  np.testing.assert_allclose(loss, loss8, rtol=1e-5)


def test_save_and_restore_move_shards_only_and_store_no_padding(config, tmp_path, caplog,
                                                                monkeypatch):
  with config.unlocked():  # 1001 rows: 126 a shard on 8 devices, 251 on 4, never even
    config.data.table_sizes = (1001,) + tuple(config.data.table_sizes[1:])
  mesh8, mesh4 = _mesh(8), _mesh(4)
  model, optimizer, source = _state(config, mesh8)
  model4, optimizer4, _ = _state(config, mesh4)
  table = model.embeddings.tables["f0"]
  physical8, physical4 = table.physical_table(), model4.embeddings.tables["f0"].physical_table()
  rows8 = physical8.sharding.shard_shape(physical8.shape)[0]
  rows4 = physical4.sharding.shard_shape(physical4.shape)[0]
  assert physical8.shape == (1008, 16) and (rows8, rows4) == (126, 251)
  reads = []
  read_region = sharded._read_region
  monkeypatch.setattr(sharded, "_read_region",
                      lambda store, region: reads.append(region) or read_region(store, region))

  ckpt = checkpoint.Checkpointer(str(tmp_path), asynchronous=False)
  with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
    ckpt.save(2, model, optimizer, source.get_state())
    ckpt.wait()
    ckpt.restore(model4, optimizer4)
  # No XLA program ran: nothing was gathered, sliced or padded on a device.
  assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]

  # On disk: the logical table, one chunk per saving shard, no padding.
  key = urllib.parse.quote("tables/embeddings/tables/f0", safe="")
  store = ts.open({"driver": "zarr", "kvstore": {
      "driver": "file", "path": str(tmp_path / "2" / "tables" / key)}}).result()
  assert store.shape == (1001, 16) and store.chunk_layout.read_chunk.shape == (126, 16)
  spec = setup.task(config).data_spec()
  shapes = ckpt._manager.item_metadata(2)["tables"]
  for f in spec.features:
    assert shapes[f"tables/embeddings/tables/{f.name}"].shape == (f.num_embeddings, 16)
    assert shapes[f"slots/embeddings/tables/{f.name}/acc"].shape == (f.num_embeddings,)

  # Restoring onto 4 devices read at most one new shard at a time, and each
  # device holds its own shard of the restored table.
  assert (slice(753, 1001), slice(0, 16)) in reads  # f0's last shard, without its padding
  assert max(r[0].stop - r[0].start for r in reads) <= rows4
  restored = model4.embeddings.tables["f0"].physical_table()
  assert {s.data.shape for s in restored.addressable_shards} == {(rows4, 16)}
  np.testing.assert_array_equal(np.asarray(model4.embeddings.tables["f0"].logical_table()),
                                np.asarray(table.logical_table()))
  ckpt.close()


class _Table(nnx.Module):
  """One table and the layout it is given, for the grid's checkpoints below."""

  def __init__(self, mesh, **layout):
    self.emb = embedlib.ShardedEmbed(99, 9, mesh=mesh, rngs=nnx.Rngs(0), **layout)


def _grid_state(shape, names, **layout):
  """A 99 x 9 table (padded both ways as a grid) and its LazyAdam (row and table slots)."""
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape),
                       devices=jax.devices()[:int(np.prod(shape))])
  model = _Table(mesh, **layout)
  return model, optim.SparseAwareOptimizer(model, None, optim.LazyAdam(0.1))


def _logical(model, optimizer):
  emb = model.emb
  n, f = emb.plan.logical_shape
  slots = {k: np.asarray(v[...])[:n, :f] if v[...].ndim == 2 else np.asarray(v[...])[:n]
           for k, v in optimizer.slots[0].items()}
  return np.asarray(emb.logical_table()), slots


# (mesh shape, names, layout): the grid on 8 devices, the 1-D layouts, a
# grid the other way round on 4.
GRID = ((2, 4), ("fsdp", "tensor"), {"sharding": "grid", "table_axes": "tensor"})
ONTO = {
    "vocab": ((2, 4), ("data", "model"), {"sharding": "vocab"}),
    "hidden": ((8,), ("model",), {"sharding": "hidden"}),
    "grid-4": ((2, 2), ("fsdp", "tensor"), {"sharding": "grid", "table_axes": "fsdp",
                                            "column_axes": "tensor"}),
}


@pytest.mark.parametrize("onto", list(ONTO))
def test_grid_checkpoint_restores_onto_other_layouts_and_back(onto, tmp_path, monkeypatch):
  model, optimizer = _grid_state(GRID[0], GRID[1], **GRID[2])
  assert model.emb.plan.padded_shape == (100, 10)

  @nnx.jit
  def step(model, optimizer, ids):
    _, grads = optim.value_and_grad(lambda m: jnp.sum(jnp.tanh(m.emb(ids))))(model)
    optimizer.update(model, grads)

  step(model, optimizer, jnp.array([[0, 98, 5, 5], [50, 49, 98, 7]], jnp.int32))
  want = _logical(model, optimizer)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "grid"), asynchronous=False)
  ckpt.save(1, model, optimizer, {})
  ckpt.wait()
  other, other_opt = _grid_state(ONTO[onto][0], ONTO[onto][1], **ONTO[onto][2])
  ckpt.restore(other, other_opt)
  ckpt.close()
  got = _logical(other, other_opt)
  np.testing.assert_array_equal(got[0], want[0])
  for k in want[1]:
    np.testing.assert_array_equal(got[1][k], want[1][k], err_msg=k)
  physical = np.asarray(other.emb.embedding[...])
  assert not physical[99:].any() and not physical[:, 9:].any()

  # And back: the 1-D (or other grid) checkpoint onto a fresh grid.
  back = checkpoint.Checkpointer(str(tmp_path / onto), asynchronous=False)
  back.save(1, other, other_opt, {})
  back.wait()
  grid, grid_opt = _grid_state(GRID[0], GRID[1], **GRID[2])
  reads = []
  read_region = sharded._read_region
  monkeypatch.setattr(sharded, "_read_region",
                      lambda store, region: reads.append(region) or read_region(store, region))
  back.restore(grid, grid_opt)
  back.close()
  # Each device read its own block of rows and columns, never the table.
  assert reads and max(np.prod([s.stop - s.start for s in r]) for r in reads) <= 25 * 5
  again = _logical(grid, grid_opt)
  np.testing.assert_array_equal(again[0], want[0])
  for k in want[1]:
    np.testing.assert_array_equal(again[1][k], want[1][k], err_msg=k)
  assert grid.emb.embedding[...].sharding.is_equivalent_to(model.emb.embedding[...].sharding, 2)
