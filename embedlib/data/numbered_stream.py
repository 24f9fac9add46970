"""A stream of numbered batches: position, process slices, state.

A batch is made from its number alone, so resuming sets ``position`` and a
checkpoint holds only that number; each process makes only its own rows of
a global batch. Subclasses implement ``batch(index)``.
"""

from __future__ import annotations

from collections.abc import Iterator


class NumberedStream(Iterator[dict]):
  """Iteration, state and process slicing; subclasses implement ``batch``.

  Args:
    batch_size: global batch size; each process yields
      ``batch_size // process_count`` rows.
    process_index: this process's index in ``[0, process_count)``.
    process_count: processes sharing each global batch.
    num_batches: stop after this many batches, or None for an endless stream.
  """

  def __init__(self, *, batch_size: int, process_index: int = 0, process_count: int = 1,
               num_batches: int | None = None):
    if not 0 <= process_index < process_count:
      raise ValueError(
          f"process_index={process_index} must lie in [0, process_count={process_count}).")
    if batch_size < 1 or batch_size % process_count:
      raise ValueError(
          f"config.batch_size={batch_size} must be a positive multiple of "
          f"process_count={process_count}; each process yields batch_size // process_count "
          "rows.")
    self.batch_size = batch_size
    self.local_batch_size = batch_size // process_count
    self.process_index, self.process_count = process_index, process_count
    self.num_batches = num_batches
    self._position = 0

  @property
  def position(self) -> int:
    """Number of the next batch ``next`` yields; set it to resume."""
    return self._position

  @position.setter
  def position(self, value: int) -> None:
    if value < 0:
      raise ValueError(f"position must be >= 0, got {value}.")
    self._position = int(value)

  def get_state(self) -> dict:
    """The data position, for a checkpoint: ``{"position": next batch number}``."""
    return {"position": self._position}

  def set_state(self, state: dict) -> None:
    self.position = state["position"]

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self.num_batches is not None and self._position >= self.num_batches:
      raise StopIteration
    batch = self.batch(self._position)
    self._position += 1
    return batch

  def __len__(self) -> int:
    if self.num_batches is None:
      raise TypeError("an endless source (num_batches=None) has no len().")
    return self.num_batches

  def batch(self, index: int) -> dict:
    """This process's rows of global batch ``index`` (position unchanged)."""
    raise NotImplementedError
