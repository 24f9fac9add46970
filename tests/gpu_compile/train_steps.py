"""A config's train step, built the way ``train`` builds it, as abstract arrays on GPU devices.

``embedlib.training.setup.model_and_optimizer`` builds the model and its
``SparseAwareOptimizer`` from the config; here it runs under
``nnx.eval_shape`` (nothing is allocated, so the documented sizes cost
nothing) with the compile-only mesh. Its last step, placing unplaced dense
arrays replicated on the mesh (``setup._on_mesh``), runs a jitted copy,
which an abstract build can't: the abstract state gets the same replicated
sharding instead. The batch is the task's own (``featurize`` of its first
training batch; synthetic rows for the click task, whose source reads
Criteo files), as ``train`` places it.
"""

from __future__ import annotations

from unittest import mock

import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import data as data_lib
from embedlib.kernels import deviceless
from embedlib.training import setup, steps, tasks
from tests.gpu_compile import compiled


def mesh_for(config, target: str, num_devices: int = 8):
  """``setup.make_mesh``'s mesh (``-1``: the rest) on ``num_devices`` compile-only GPUs."""
  shape = list(config.mesh_shape)
  if -1 in shape:
    known = 1
    for s in shape:
      known *= s if s != -1 else 1
    shape[shape.index(-1)] = num_devices // known
  axes = tuple(config.mesh_axes)
  return deviceless.gpu_mesh(shape, axes, target=target, axis_types=(AxisType.Auto,) * len(axes))


def host_batch(config, task, spec):
  if isinstance(task, tasks.CTRTask):  # its sources read files; its batches are synthetic
    return next(data_lib.SyntheticSource(spec, batch_size=config.batch_size))
  train, _ = setup.sources(config, task, spec)
  return task.featurize(next(iter(train)))


def abstract_model(config, mesh):
  """``(graphdef, abstract state, abstract batch)`` of the config's model and optimizer."""
  task = tasks.make_task(config)  # the model alone: a criteo config names no files here
  spec = task.data_spec()
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    with mock.patch.object(setup, "_on_mesh", lambda module, mesh: None):
      pair = nnx.eval_shape(lambda: setup.model_and_optimizer(config, task, spec, mesh))
  graphdef, state = nnx.split(pair)
  batch_sharding = NamedSharding(mesh, P(tuple(config.mesh_axes)))
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding),
                       host_batch(config, task, spec))
  return graphdef, compiled.abstract(state, mesh), batch


def train_step(config, mesh):
  """``(step, abstract state, abstract batch)``: ``step(state, batch) -> (loss, state)``."""
  graphdef, state, batch = abstract_model(config, mesh)
  task = tasks.make_task(config)  # the model alone: a criteo config names no files here

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss = steps.train_step(model, optimizer, batch, task=task)
    return loss, nnx.state((model, optimizer))

  return step, state, batch
