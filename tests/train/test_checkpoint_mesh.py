"""A checkpoint saved on 8 devices restores onto 4, 3 and 1 device.

Checkpoints hold logical (unpadded) tables and slots, so a new mesh with new
padding gets identical tables and single-hot lookups, and the same next
step. Tolerances: pooled bags add their rows' partial sums across ranks in
a mesh-dependent order (1e-6 relative), and so does the all-reduce of the
dense gradients, which the next-step loss sees (1e-5).
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from configs import quickstart
from embedlib import checkpoint
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
    padded = {t.embedding.shape for t in model_n.embeddings.tables.values()}
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


def test_checkpoint_holds_no_padding(config, tmp_path):
  mesh3 = _mesh(3)
  model, optimizer, _ = _state(config, mesh3)
  state = checkpoint.logical_state(model, optimizer)
  spec = setup.data_spec(config)
  assert len(state["tables"]) == len(spec.features)
  for f in spec.features:
    (key,) = [k for k in state["tables"] if k.endswith(f.name)]
    assert model.embeddings.tables[f.name].embedding.shape[0] > f.num_embeddings or (
        f.num_embeddings % 3 == 0)
    assert state["tables"][key].shape == (f.num_embeddings, config.model.embed_dim)
    for slot in state["slots"][key].values():
      assert slot.shape[0] == f.num_embeddings
