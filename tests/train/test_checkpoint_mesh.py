"""A checkpoint saved on 8 devices restores onto 4, 3 and 1 device, shard by shard.

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
import numpy as np
import pytest
import tensorstore as ts
from flax import nnx
from jax.sharding import AxisType

from configs import quickstart
from embedlib import checkpoint
from embedlib.checkpoint import sharded
from embedlib import data as data_lib
from embedlib.training import setup, train_lib


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
  spec = setup.data_spec(config)
  model, optimizer = setup.model_and_optimizer(config, spec, mesh)
  source, _ = setup.sources(config, spec)
  return model, optimizer, source


def test_restore_on_fewer_devices_gives_identical_lookups_and_next_step(config, tmp_path):
  mesh8 = _mesh(8)
  model, optimizer, source = _state(config, mesh8)
  for _ in range(2):
    train_lib.train_step(model, optimizer, data_lib.to_global_batch(next(source), mesh8))
  ckpt = checkpoint.Checkpointer(str(tmp_path), asynchronous=False)
  ckpt.save(2, model, optimizer, source.get_state())
  ckpt.wait()
  batch = next(source)
  tables8 = {k: np.asarray(t.logical_table()) for k, t in model.embeddings.tables.items()}
  lookups8 = {k: np.asarray(v) for k, v in
              _lookups(model.embeddings, data_lib.to_global_batch(batch, mesh8)["sparse"]).items()}
  loss8 = float(train_lib.train_step(model, optimizer, data_lib.to_global_batch(batch, mesh8)))

  for n in (4, 3, 1):
    mesh = _mesh(n)
    model_n, optimizer_n, source_n = _state(config, mesh)
    source_n.set_state(ckpt.restore(model_n, optimizer_n))
    assert source_n.position == 2
    padded = {t.physical_table().shape for t in model_n.embeddings.tables.values()}
    for k, t in model_n.embeddings.tables.items():
      np.testing.assert_array_equal(np.asarray(t.logical_table()), tables8[k])
    global_batch = data_lib.to_global_batch(next(source_n), mesh)
    for k, v in _lookups(model_n.embeddings, global_batch["sparse"]).items():
      if global_batch["sparse"][k].ndim == 1:  # single-hot: bit-identical
        np.testing.assert_array_equal(np.asarray(v), lookups8[k])
      else:  # pooled bags sum partial rows in a mesh-dependent order
        np.testing.assert_allclose(np.asarray(v), lookups8[k], rtol=1e-6, atol=1e-7)
    loss = float(train_lib.train_step(model_n, optimizer_n, global_batch))
    np.testing.assert_allclose(loss, loss8, rtol=1e-5)
    assert padded  # the physical shapes differ per mesh; the logical ones don't
  ckpt.close()


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
  spec = setup.data_spec(config)
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
