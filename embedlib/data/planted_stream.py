"""What the planted sources share: position, process slices, state.

Each example is a pure function of ``(seed, split, example index)``, so a
batch is made from its number alone (resuming sets ``position``), each
process makes only its own rows of a global batch, and N processes together
make exactly the batches one process would.
"""

from __future__ import annotations

import numpy as np

from embedlib.data.numbered_stream import NumberedStream


class PlantedStream(NumberedStream):
  """A numbered stream whose rows come from ``_generate``; see ``NumberedStream``."""

  def batch(self, index: int) -> dict:
    """This process's rows of global batch ``index`` (position unchanged)."""
    start = index * self.batch_size + self.process_index * self.local_batch_size
    return self._generate(start, self.local_batch_size)[0]

  def with_truth(self, num_batches: int | None = None, start: int = 0):
    """Yields ``(batch, truth)`` for whole global batches ``start, ...``.

    ``truth`` is what the hidden model knows (the source's ``_generate``
    documents it); every process gets all rows, for the oracle's metrics.
    """
    num_batches = self.num_batches if num_batches is None else num_batches
    if num_batches is None:
      raise ValueError("the oracle needs a finite set: pass num_batches=, or build the "
                       "source with num_batches=.")
    for index in range(start, start + num_batches):
      yield self._generate(index * self.batch_size, self.batch_size)

  def _generate(self, start: int, count: int) -> tuple[dict, object]:
    raise NotImplementedError


def counters(start: int, count: int) -> np.ndarray:
  return np.arange(start, start + count, dtype=np.uint64)
