"""A tied table's dense optimizer slots restore onto another device count.

SASRec's item table is tied to its output layer and trained by the dense
optimizer (Adam through ``nnx.Optimizer``), whose slots have the table's
padded shape: 61 rows are 61 on one device, 64 on four, 63 on three. The
checkpoint stores the table and those slots at their logical shape, so a run
saved on one device count resumes on another (and exports onto any), its
slots equal to the saved ones with zero padding rows, and its next step the
one it would have taken. Tolerance of the next step: the dense gradients'
all-reduce adds partial sums in a mesh-dependent order (1e-5).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from configs import movielens
from embedlib import checkpoint
from embedlib import data as data_lib
from embedlib import param as param_lib
from embedlib.training import export_lib, setup, train_lib
from tests.train.test_sequential import write_ml100k

TIED = ("embed", "items", "embedding")  # the item table's path in the model and the slots


@pytest.fixture(scope="module")
def config(tmp_path_factory):
  config = movielens.get_config("smoke")
  config.data.path = str(write_ml100k(tmp_path_factory.mktemp("data") / "ml-100k"))
  config.batch_size = 24  # divides 4, 3 and 1 devices
  return config


def _state(config, n):
  mesh = export_lib.serving_mesh(config, n)
  task = setup.task(config)
  model, optimizer = setup.model_and_optimizer(config, task, task.data_spec(), mesh)
  source, _ = setup.sources(config, task, task.data_spec())
  return model, optimizer, source, task, mesh


def _slots(optimizer):
  """``{slot path: (logical slot, stored slot)}`` of the tied table's optax slots."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(optimizer.dense)):
    if tuple(path[-3:]) == TIED:
      out[path] = (np.asarray(param_lib.logical(var)), np.asarray(var.get_raw_value()))
  assert {p[2] for p in out} == {"mu", "nu"}, list(out)  # Adam's two
  return out


def _step(model, optimizer, source, task, mesh):
  batch = data_lib.to_global_batch(task.featurize(next(source)), mesh)
  return float(train_lib.train_step(model, optimizer, batch, task=task))


@pytest.fixture(scope="module")
def saved(config, tmp_path_factory, request):
  """A run saved at step 2 on ``n`` devices: its workdir, slots, table and next loss."""
  n = request.param
  model, optimizer, source, task, mesh = _state(config, n)
  for _ in range(2):
    _step(model, optimizer, source, task, mesh)
  workdir = tmp_path_factory.mktemp(f"saved{n}")
  ckpt = checkpoint.Checkpointer(str(workdir / "checkpoints"), asynchronous=False)
  ckpt.save(2, model, optimizer, source.get_state())
  ckpt.close()
  slots = {p: logical for p, (logical, _) in _slots(optimizer).items()}
  table = np.asarray(model.embed.items.embedding[...])
  loss = _step(model, optimizer, source, task, mesh)
  after = {p: logical for p, (logical, _) in _slots(optimizer).items()}
  return n, workdir, slots, table, loss, after


@pytest.mark.parametrize("saved", [1], indirect=True)
def test_a_one_device_run_restores_for_serving_on_four_scoring_as_it_did(config, saved,
                                                                           monkeypatch):
  """``train.export --devices 4``'s restore (``setup.restore_model``) of a one-device run.

  It builds and reads no optimizer state: only the model's parameters.
  """
  _, workdir, _, table, _, _ = saved

  def no_optimizer(*args, **kwargs):
    raise AssertionError("restore_model built an optimizer")
  monkeypatch.setattr(setup.optim, "SparseAwareOptimizer", no_optimizer)
  mesh = export_lib.serving_mesh(config, 4)
  model, _ = setup.restore_model(config, str(workdir), mesh=mesh)
  assert model.embed.items.plan.padded_shape[0] == 64
  np.testing.assert_array_equal(np.asarray(model.embed.items.embedding[...]), table)
  one, _ = setup.restore_model(config, str(workdir), mesh=export_lib.serving_mesh(config, 1))
  task = setup.task(config)
  batch = task.featurize(next(setup.sources(config, task, task.data_spec())[1]))
  inputs = {k: batch[k] for k in ("items", "times", "query_times")}
  scores = nnx.jit(lambda m, b: m.logits(m(b)[:, -1], b["items"]))
  model.eval()
  one.eval()
  np.testing.assert_allclose(np.asarray(scores(model, inputs)), np.asarray(scores(one, inputs)),
                             rtol=1e-5, atol=1e-6)


# 1 -> 4: the table and slots gain 3 padding rows; 4 -> 3: 64 rows become 63;
# 4 -> 1: no padding at all.
@pytest.mark.parametrize("saved, onto", [(1, 4), (4, 3), pytest.param(4, 1, marks=pytest.mark.slow)],
                         indirect=["saved"])
def test_a_resumed_run_gets_the_saved_dense_slots_logically_and_the_same_next_step(
    config, saved, onto):
  _, workdir, slots, table, loss, after = saved
  model, optimizer, source, task, mesh = _state(config, onto)
  ckpt = checkpoint.Checkpointer(str(workdir / "checkpoints"), asynchronous=False)
  source.set_state(ckpt.restore(model, optimizer))
  ckpt.close()
  np.testing.assert_array_equal(np.asarray(model.embed.items.embedding[...]), table)
  rows = model.embed.items.plan.padded_shape[0]
  for path, (logical, stored) in _slots(optimizer).items():
    np.testing.assert_array_equal(logical, slots[path], err_msg=str(path))
    assert stored.shape[0] == rows  # laid out again for this mesh's compiled step
    assert not stored[len(logical):].any(), path  # padding rows zero
  np.testing.assert_allclose(_step(model, optimizer, source, task, mesh), loss, rtol=1e-5)
  for path, (logical, _) in _slots(optimizer).items():
    np.testing.assert_allclose(logical, after[path], rtol=1e-4, atol=1e-7, err_msg=str(path))


def test_slots_an_earlier_embedlib_saved_padded_restore_onto_their_own_layout(
    config, tmp_path, monkeypatch):
  """Such a checkpoint resumes where it was saved; onto other padding it is a mismatch."""
  model, optimizer, source, _, _ = _state(config, 4)
  rng = np.random.default_rng(0)
  variables = dict(nnx.to_flat_state(nnx.state(optimizer.dense)))
  for path, (logical, stored) in _slots(optimizer).items():
    values = np.zeros_like(stored)
    values[:len(logical)] = rng.standard_normal(logical.shape)
    raw = variables[path].get_raw_value()
    param_lib.set_physical(variables[path], jax.device_put(values, raw.sharding))
  want = {p: logical for p, (logical, _) in _slots(optimizer).items()}
  ckpt = checkpoint.Checkpointer(str(tmp_path), asynchronous=False)
  with monkeypatch.context() as patch:  # the earlier save: slots as stored
    patch.setattr(checkpoint.logical, "_logical_leaf",
                  lambda x: x.get_value() if isinstance(x, nnx.Variable) else x)
    ckpt.save(2, model, optimizer, source.get_state())
  model, optimizer, _, _, _ = _state(config, 4)
  ckpt.restore(model, optimizer)
  for path, (logical, stored) in _slots(optimizer).items():
    np.testing.assert_array_equal(logical, want[path], err_msg=str(path))
    assert stored.shape[0] == 64 and not stored[61:].any()
  model, optimizer, _, _, _ = _state(config, 3)
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r"float32\[64, 16\] in the "
                     r"checkpoint, float32\[61, 16\] in the model"):
    ckpt.restore(model, optimizer)
  ckpt.close()
