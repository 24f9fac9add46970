"""Early fetch's two pieces of arithmetic: room for corrected rows, and which rows changed.

A pipelined step may read a routed or vocab table's rows with the ids,
a step before its own (``strategies.sharded.distribute_rows``); the step
then reads them again and sends only the rows whose bits changed
(``routed.rows_up_to_date``, ``vocab.rows_up_to_date``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax


def correction_capacity(capacity: int, early_fetch: float) -> int:
  """Corrected rows each owner can send each rank: ``early_fetch`` of the route's slots.

  >>> correction_capacity(40, 0.25), correction_capacity(3, 0.01)
  (10, 1)
  """
  return max(1, min(capacity, int(np.ceil(capacity * early_fetch))))


def changed_rows(fresh, stale):
  """bool ``fresh.shape[:-1]``: the rows whose bits differ (``-0.0`` differs from ``0.0``)."""
  width = np.dtype(fresh.dtype).itemsize * 8
  bits = lambda x: lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}"))
  return jnp.any(bits(fresh) != bits(stale), axis=-1)
