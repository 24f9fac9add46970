"""What the compiled train and eval steps hold: no copy of a table (XLA's memory analysis).

Compiled, never run, on the Criteo config's smoke model over 8 devices.
"""

import jax
import numpy as np
import pytest

from configs import dlrm_criteo
from embedlib import data as data_lib
from embedlib.training import setup, steps, tasks

ROWS = 20_000


@pytest.fixture(scope="module")
def built():
  config = dlrm_criteo.get_config("smoke")
  config.data.table_sizes = (ROWS,) * 26
  mesh = setup.make_mesh(config)
  task = tasks.make_task(config)  # no data files: the model and a synthetic batch only
  spec = task.data_spec()
  model, optimizer = setup.model_and_optimizer(config, task, spec, mesh)
  batch = data_lib.to_global_batch(
      data_lib.SyntheticSource(spec, batch_size=config.batch_size).__next__(), mesh)
  table_shard = ROWS * config.model.embed_dim * 4 // mesh.size
  return model, optimizer, batch, config.batch_size, mesh.size, table_shard, task


def test_eval_step_outputs_only_the_logits(built):
  # nnx.jit's default would return every variable, so each eval batch wrote a
  # fresh copy of all 26 tables.
  model, _, batch, batch_size, devices, table_shard, task = built
  analysis = steps.eval_step.lower(model, batch, task=task).compile().memory_analysis()
  assert analysis.output_size_in_bytes == batch_size * 4 // devices
  assert analysis.argument_size_in_bytes >= 26 * table_shard  # the tables are its inputs


def test_train_step_writes_the_tables_in_place(built):
  model, optimizer, batch, _, _, table_shard, task = built
  analysis = steps.train_step.lower(model, optimizer, batch,
                                    task=task).compile().memory_analysis()
  assert analysis.alias_size_in_bytes >= 26 * table_shard
  # What isn't aliased: the loss and a few scalars, far below one table's shard.
  assert analysis.output_size_in_bytes - analysis.alias_size_in_bytes < table_shard // 100


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_step_after_a_save_updates_the_tables_in_place(built, tmp_path, monkeypatch,
                                                         asynchronous):
  # A write still reading the shards keeps them referenced: the step holds a
  # second copy of every table. The default save is done first, and the
  # step after it updates the tables in place.
  import asyncio  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top

  from embedlib import checkpoint, optim  # pylint: disable=g-import-not-at-top
  from embedlib import param as param_lib  # pylint: disable=g-import-not-at-top
  from embedlib.checkpoint import sharded  # pylint: disable=g-import-not-at-top

  # The background write is held until the step has run: otherwise a write
  # that ends before the step starts (a fast disk, a warm process) leaves
  # nothing in flight, and the case would test nothing.
  step_done = threading.Event()
  write = sharded.ShardedArraysHandler._write

  async def held_write(self, directory, pieces):
    await asyncio.to_thread(step_done.wait, 60)
    await write(self, directory, pieces)

  monkeypatch.setattr(sharded.ShardedArraysHandler, "_write", held_write)
  model, optimizer, batch, *_, task = built
  ckpt = checkpoint.Checkpointer(str(tmp_path), asynchronous=asynchronous)
  try:
    if not asynchronous:
      step_done.set()  # a synchronous save returns once written
    ckpt.save(1, model, optimizer, {})
    _, emb = next(iter(optim.sparse_tables(model)))
    before = param_lib.physical(emb.embedding)
    want = np.array(before)
    jax.block_until_ready(steps.train_step(model, optimizer, batch, task=task))
    in_place = before.is_deleted()
    step_done.set()
  finally:
    step_done.set()
    ckpt.close()
  if not asynchronous:
    assert in_place
    return
  # With the write in flight, jax versions differ: 0.10 and 0.12.0 refuse
  # the donation (the table stays valid, and XLA writes a copy), 0.12.1
  # accepts it and keeps the buffer the write reads alive beside the step's
  # new one. Either way the step holds a second copy of the tables while
  # the write runs (Checkpointer's docstring), and the checkpoint must hold
  # the table as it was before the step.
  restored = checkpoint.Checkpointer(str(tmp_path))
  try:
    assert restored.restore_newest(model, optimizer)[0] == 1
  finally:
    restored.close()
  np.testing.assert_array_equal(np.asarray(param_lib.physical(emb.embedding)), want)
