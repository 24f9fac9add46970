"""Orbax checkpoints of logical training state plus the data position."""

from __future__ import annotations

import os

import orbax.checkpoint as ocp

from embedlib.checkpoint import logical


class Checkpointer:
  """Saves (asynchronously) and restores training state by step.

  >>> import tempfile
  >>> ckpt = Checkpointer(tempfile.mkdtemp())
  >>> ckpt.latest_step() is None
  True

  Args:
    directory: where checkpoints go (``workdir/checkpoints``).
    max_to_keep: how many recent checkpoints to keep.
    asynchronous: write in the background while training continues.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3, asynchronous: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=asynchronous, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, model, optimizer, data_state: dict) -> None:
    """Starts saving ``model``/``optimizer`` (logical form) and the data position."""
    state = logical.logical_state(model, optimizer)
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))

  def restore(self, model, optimizer, step: int | None = None) -> dict:
    """Loads a checkpoint into a model built for any mesh; returns the data state.

    Args:
      model: freshly built model (same config; the mesh may differ).
      optimizer: its ``SparseAwareOptimizer``.
      step: which checkpoint; default the latest.

    Returns:
      The data source state saved with it.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory} to restore.")
    mesh = next((e.mesh for _, e in logical.row_grads.sparse_tables(model, optimizer.tables)),
                None)
    target = logical.abstract_like(logical.logical_state(model, optimizer), mesh)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    logical.load_logical_state(model, optimizer, restored["state"])
    return restored["data"]

  def wait(self) -> None:
    """Blocks until background saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
