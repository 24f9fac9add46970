"""Orbax checkpoints of logical training state plus the data position.

Two faults get handled here rather than surfacing as raw TensorStore errors:

* A checkpoint that no longer restores (a data file truncated or deleted,
  garbage in its metadata) is moved aside into ``<directory>/corrupt/`` with
  a warning naming it and why, and the next newest one is tried. One saved
  from a different model config is *not* corrupt: that raises
  ``CheckpointMismatchError`` and moves nothing.
* A save that fails (a full disk, a vanished directory) raises
  ``CheckpointSaveError`` naming the step, the path and the cause, from
  ``save`` (or, with ``asynchronous=True``, the next ``check``/``save``/``wait``
  after the background write ends); the checkpoints written before it stay
  as they were.
"""

from __future__ import annotations

import json
import logging
import os
import re

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from embedlib import host_memory
from embedlib.checkpoint import logical, sharded

log = logging.getLogger(__name__)

#: Subdirectory of the checkpoint directory that holds checkpoints which failed to restore.
CORRUPT_DIR = "corrupt"


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written; the message names the step, path and cause."""


class CheckpointRestoreError(RuntimeError):
  """Checkpoints exist but none restores (each was moved into ``corrupt/``)."""


class CheckpointMismatchError(ValueError):
  """A checkpoint was saved from another model config (its arrays differ from the model's)."""


#: The checkpoint's JSON files (orbax's, zarr's and ours): a parse error of one
#: (``Expecting value: line 1 ...``) names no file, so a failed restore looks for it.
_JSON_NAMES = ("_CHECKPOINT_METADATA", "_METADATA", "metadata", ".zarray", "arrays.json")


def _unreadable_json(directory: str) -> str | None:
  """``"<path>: <parse error>"`` of the first JSON file in ``directory`` that doesn't parse."""
  for root, dirs, files in os.walk(directory):
    dirs.sort()
    for name in sorted(files):
      if name in _JSON_NAMES:
        path = os.path.join(root, name)
        try:
          with open(path, encoding="utf-8") as f:
            json.load(f)
        except (OSError, ValueError) as e:
          return f"{path}: {e}"
  return None


def _cause(exc: BaseException, directory: str | None = None) -> str:
  """The most specific one-line reason in an exception chain: an OS error's if any.

  With ``directory`` (a checkpoint's), a reason that names no file in it
  names the checkpoint's unreadable JSON file instead, when there is one.
  """
  text = _reason(exc)
  if directory is not None and directory not in text:
    text = _unreadable_json(directory) or f"{text} in {directory}"
  return text


def _reason(exc: BaseException) -> str:
  seen, chain = set(), []
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    chain.append(exc)
    exc = exc.__cause__ or exc.__context__
  for e in chain:
    if isinstance(e, OSError) and e.strerror:
      return f"{e.strerror} ({e.filename})" if e.filename else e.strerror
  for e in chain:  # tensorstore's errors carry the OS error as a code, after a page of context
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code:
      paths = re.findall(r'"(/[^"]+)"', str(e))
      return os.strerror(int(code.group(1))) + (f" ({paths[-1]})" if paths else "")
  text = str(chain[-1]).strip() or type(chain[-1]).__name__
  first = re.sub(r"\s*\[tensorstore_spec=.*", "", text.splitlines()[0])
  return first if len(first) <= 300 else first[:297] + "..."


def _key(path) -> str:
  """``"a/0/b"`` of a pytree path: orbax's metadata keys list items by str, the model by int."""
  def name(key):
    return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
  return "/".join(name(k) for k in path)


def _flat(tree) -> dict:
  """``{"a/0/b": leaf}`` of a pytree."""
  return {_key(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _metadata_mismatch(saved: dict, target: dict) -> list[str]:
  """Keys whose presence, shape or dtype differs between a checkpoint and a model."""
  flat_saved, flat_target = _flat(saved), _flat(target)
  problems = [f"{k} only in the checkpoint" for k in sorted(set(flat_saved) - set(flat_target))]
  problems += [f"{k} missing from the checkpoint" for k in sorted(set(flat_target) - set(flat_saved))]
  for key in sorted(set(flat_saved) & set(flat_target)):
    s, t = flat_saved[key], flat_target[key]
    if tuple(s.shape) != tuple(t.shape) or s.dtype != t.dtype:
      problems.append(f"{key} is {s.dtype}{list(s.shape)} in the checkpoint, "
                      f"{t.dtype}{list(t.shape)} in the model")
  return problems


class Checkpointer:
  """Saves and restores training state by step.

  >>> import tempfile
  >>> ckpt = Checkpointer(tempfile.mkdtemp())
  >>> ckpt.latest_step() is None
  True

  Args:
    directory: where checkpoints go (``workdir/checkpoints``).
    max_to_keep: how many recent checkpoints to keep.
    asynchronous: return from ``save`` before the arrays are on disk and write
      them while training continues. Off by default: a write in flight holds
      every shard of every table (host views of the device buffers), so the
      next donated train step can't update the tables in place and XLA
      copies them all, 1x the tables more until the write ends (and host
      memory that stays fragmented after it). Only for state that isn't
      donated while the write runs.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3, asynchronous: bool = False):
    self.directory = os.path.abspath(directory)
    self.corrupt_directory = os.path.join(self.directory, CORRUPT_DIR)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=asynchronous, create=True,
        cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "tables": sharded.ShardedArraysHandler(),
                       "data": ocp.JsonCheckpointHandler()})
    self._pending = None  # step of a save whose outcome hasn't been checked

  def latest_step(self) -> int | None:
    """The newest finished checkpoint's step (it may still fail to restore)."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  # -- saving --------------------------------------------------------------------

  def save(self, step: int, model, optimizer, data_state: dict) -> None:
    """Starts saving ``model``/``optimizer`` (logical form) and the data position.

    Raises:
      CheckpointSaveError: this save, or an earlier background one, failed.
    """
    self.wait()  # one save in flight at a time; surfaces an earlier failure first
    dense, tables = logical.split_state(model, optimizer)
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(dense), tables=sharded.ShardedArraysSave(tables),
          data=ocp.args.JsonSave(data_state)))
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._save_error(step, e) from None
    self._pending = step
    if not self._manager.is_saving_in_progress():
      host_memory.release_freed()  # the writers' encoding buffers, one per shard

  def check(self) -> None:
    """Raises ``CheckpointSaveError`` if a background save has ended in failure.

    Never blocks: a save still being written is checked by a later call.
    """
    if self._pending is not None and not self._manager.is_saving_in_progress():
      self.wait()

  def wait(self) -> None:
    """Blocks until background saves are on disk.

    Raises:
      CheckpointSaveError: the last save failed.
    """
    step, self._pending = self._pending, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise self._save_error(step, e) from None

  def _save_error(self, step, exc) -> CheckpointSaveError:
    self._manager.reload()
    intact = [s for s in self.all_steps() if s != step]
    keep = (f"the checkpoint at step {intact[-1]} is intact and a rerun resumes from it"
            if intact else "no earlier checkpoint exists")
    return CheckpointSaveError(
        f"could not write the checkpoint at step {step} to {self.directory}: {_cause(exc)}. "
        f"Training stopped; {keep}. Free space (or fix the directory), then rerun.")

  # -- restoring -----------------------------------------------------------------

  def restore(self, model, optimizer, step: int | None = None) -> dict:
    """Loads a checkpoint into a model built for any mesh; returns the data state.

    Args:
      model: freshly built model (same config; the mesh may differ).
      optimizer: its ``SparseAwareOptimizer``.
      step: which checkpoint; default the newest that restores (see
        ``restore_newest``).

    Returns:
      The data source state saved with it.

    Raises:
      FileNotFoundError: there is no checkpoint (at ``step``).
      CheckpointMismatchError: it was saved from another model config.
    """
    if step is None:
      found = self.restore_newest(model, optimizer)
      if found is None:
        raise FileNotFoundError(f"no checkpoint in {self.directory} to restore.")
      return found[1]
    if step not in self.all_steps():
      raise FileNotFoundError(
          f"no checkpoint at step {step} in {self.directory}; it holds {self.all_steps()}.")
    return self._restore(step, model, optimizer, logical.restore_targets(model, optimizer))

  def restore_model(self, model, keys: tuple[str, ...], step: int | None = None) -> int:
    """Loads only ``model``'s parameters (serving, export); returns the step read.

    No optimizer is built and none of its state is read: neither the row-wise
    slots nor the dense optimizer's (Adam's are twice the tables it trains).
    Nothing is moved aside: a checkpoint that fails to read raises.

    Args:
      model: freshly built model (same config; the mesh may differ).
      keys: the tables the run's row-wise rule trained (its
        ``SparseAwareOptimizer.keys``; ``()`` when every table trained densely).
      step: which checkpoint; default the newest.

    Raises:
      FileNotFoundError: there is no checkpoint (at ``step``).
      CheckpointMismatchError: it was saved from another model config.
    """
    step = self.latest_step() if step is None else step
    if step not in self.all_steps():
      raise FileNotFoundError(f"no checkpoint{'' if step is None else f' at step {step}'} in "
                              f"{self.directory} to restore; it holds {self.all_steps()}.")
    stand_in = logical.ModelOnly(tuple(keys))
    dense, tables = logical.restore_targets(model, stand_in)
    self._check_matches(step, dense, tables, partial=True)
    # The dense optimizer's state is left on disk: orbax's PyTree handler
    # (what StandardCheckpointHandler writes) reads a subset of the tree.
    reader = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(read_only=True),
        item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                       "tables": sharded.ShardedArraysHandler()})
    try:
      restored = reader.restore(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
              dense, restore_args=ocp.checkpoint_utils.construct_restore_args(dense),
              partial_restore=True),
          tables=sharded.ShardedArraysRestore(tables, logical.table_loader(model, stand_in))))
    finally:
      reader.close()
    logical.load_state(model, stand_in, restored["state"])
    return step

  def restore_newest(self, model, optimizer) -> tuple[int, dict] | None:
    """Restores the newest checkpoint that restores; ``(step, data state)`` or None.

    A checkpoint that fails to restore is moved into ``corrupt/`` with a
    warning naming it and the reason, and the next newest is tried.

    Raises:
      CheckpointMismatchError: the newest readable checkpoint was saved from
        another model config (nothing is moved).
      CheckpointRestoreError: there were checkpoints, and none restores.
    """
    targets = logical.restore_targets(model, optimizer)
    steps = self.all_steps()
    for step in reversed(steps):
      try:
        return step, self._restore(step, model, optimizer, targets)
      except CheckpointMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-exception-caught
        self._set_aside(step, e)
    if steps:
      raise CheckpointRestoreError(
          f"none of the checkpoints in {self.directory} (steps {steps}) restores; each was "
          f"moved into {self.corrupt_directory} (see the warnings above for why). Rerun to "
          "start again from step 0, or move one back once it is repaired.")
    return None

  def _restore(self, step, model, optimizer, targets) -> dict:
    """Restores ``step`` into ``model``/``optimizer``; returns the data state.

    Each table and slot replaces the model's as soon as it is read, so the
    restore holds one table twice at most, not every table. The checkpoint's
    metadata and chunk files are checked first, so a damaged checkpoint
    changes nothing; one whose data fails to read (a corrupt chunk) leaves
    the tables read before it loaded, and ``restore_newest`` then loads an
    older checkpoint over every array.
    """
    dense, tables = targets
    dense = self._slots_as_saved(step, dense, logical.padded_slot_targets(optimizer))
    self._check_matches(step, dense, tables)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(dense),
        tables=sharded.ShardedArraysRestore(tables, logical.table_loader(model, optimizer)),
        data=ocp.args.JsonRestore()))
    logical.load_state(model, optimizer, restored["state"])
    return restored["data"]

  def _slots_as_saved(self, step, dense, padded: dict) -> dict:
    """``dense`` with the padded targets of slots that ``step`` holds padded.

    An embedlib before logical dense slots stored a padded table's optax
    slots padded: those restore onto the layout they were saved from (and
    are saved logical from then on); onto any other they are a mismatch.
    """
    if not padded:
      return dense
    state = self._manager.item_metadata(step)["state"]
    saved = _flat(getattr(state, "tree", state) or {})
    swap = {k: v for k, v in padded.items()
            if k in saved and tuple(saved[k].shape) == tuple(v.shape)}
    if not swap:
      return dense
    return jax.tree_util.tree_map_with_path(lambda path, leaf: swap.get(_key(path), leaf), dense)

  def _check_matches(self, step, dense, tables, partial: bool = False) -> None:
    """Raises ``CheckpointMismatchError`` if step's arrays aren't the model's.

    With ``partial``, arrays only in the checkpoint (the optimizer's, when
    restoring the model alone) are not a mismatch. Unreadable metadata is
    corruption, not a mismatch: that error propagates.
    """
    metadata = self._manager.item_metadata(step)
    saved = getattr(metadata["state"], "tree", metadata["state"])
    path = os.path.join(self.directory, str(step))
    if isinstance(saved, dict) and "tables" in saved:
      raise CheckpointMismatchError(
          f"the checkpoint at {path} was written by an earlier embedlib, which kept each "
          "table whole inside its 'state' item; this one writes tables shard by shard into "
          "'tables/'. Resume it with the embedlib that wrote it, or use a new --workdir.")
    if saved is None or metadata.get("tables") is None:
      raise ValueError(f"checkpoint {step} has no readable metadata")
    logical_shapes = {k: jax.ShapeDtypeStruct(v.logical_shape, v.array.dtype)
                      for k, v in sharded.stored(tables).items()}
    problems = (_metadata_mismatch(metadata["tables"], logical_shapes) +
                _metadata_mismatch(saved, dense))
    if partial:
      problems = [p for p in problems if not p.endswith(" only in the checkpoint")]
    if problems:
      shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
      raise CheckpointMismatchError(
          f"the checkpoint at {os.path.join(self.directory, str(step))} was saved from another "
          f"model config: {shown}. Use the config it was trained with (compare config.model "
          "and config.data), or a new --workdir.")

  def _set_aside(self, step: int, exc: BaseException) -> None:
    source = os.path.join(self.directory, str(step))
    destination = os.path.join(self.corrupt_directory, str(step))
    reason = _cause(exc, source)  # before the move: it may name a file in it
    multihost_utils.sync_global_devices(f"embedlib_checkpoint_corrupt_{step}")
    if jax.process_index() == 0:
      os.makedirs(self.corrupt_directory, exist_ok=True)
      suffix = 0
      while os.path.exists(destination):
        suffix += 1
        destination = os.path.join(self.corrupt_directory, f"{step}.{suffix}")
      os.replace(source, destination)
    multihost_utils.sync_global_devices(f"embedlib_checkpoint_corrupt_{step}_moved")
    self._manager.reload()
    older = self.all_steps()
    log.warning(
        "checkpoint %s does not restore (%s); moved it to %s and %s.", source, reason,
        destination, f"trying step {older[-1]}" if older else "no older checkpoint is left")

  def close(self) -> None:
    """Waits for the last save, then releases orbax's threads.

    Raises:
      CheckpointSaveError: the last save failed (the manager is closed anyway).
    """
    try:
      self.wait()
    finally:
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-exception-caught
        pass  # the failed save's error, raised again: wait() has reported it
