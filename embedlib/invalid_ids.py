"""The one rule for invalid ids, shared by every strategy and kernel.

An id is valid when ``0 <= id < num_embeddings``. By default an invalid id
looks up a zero vector and gets no gradient (``-1`` is the usual padding id
of recommender batches). ``nnx.Embed`` differs: it returns NaN rows for ids
past the end and wraps negative ids (numpy indexing). With
``invalid_ids="error"`` an invalid id is an error that names it and the
table size: raised at once for concrete ids, and through
``jax.experimental.checkify`` when the lookup is traced (wrap the jitted
function in ``checkify.checkify`` to get the error back).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

ZERO = "zero"
ERROR = "error"
MODES = (ZERO, ERROR)


def sanitize(ids, num_embeddings: int):
  """Maps every invalid id to ``-1`` and returns int32 ids.

  The range test runs in the ids' own dtype, so a 64-bit id beyond the table
  can't wrap into a valid int32 one.

  >>> sanitize(jnp.array([0, 4, 5, -3]), 5)
  Array([ 0,  4, -1, -1], dtype=int32)
  """
  valid = (ids >= 0) & (ids < num_embeddings)
  return jnp.where(valid, ids, -1).astype(jnp.int32)


def check(ids, num_embeddings: int, name: str) -> None:
  """Raises if any id is outside ``[0, num_embeddings)``.

  >>> check(jnp.array([1, 7]), 5, "user_id")
  Traceback (most recent call last):
  ...
  IndexError: user_id: id 7 (at flat position 1) is outside [0, 5); ...
  """
  if isinstance(ids, jax.core.Tracer):
    valid = (ids >= 0) & (ids < num_embeddings)
    first = jnp.argmin(valid.reshape(-1)) if ids.size else 0
    bad = ids.reshape(-1)[first] if ids.size else 0
    checkify.check(
        jnp.all(valid),
        f"{name}: id {{bad}} is outside [0, {num_embeddings}); use ids in "
        "range, or invalid_ids='zero' to look them up as zero vectors.",
        bad=bad,
    )
    return
  flat = np.asarray(ids).reshape(-1)
  bad = np.flatnonzero((flat < 0) | (flat >= num_embeddings))
  if bad.size:
    pos = int(bad[0])
    raise IndexError(
        f"{name}: id {flat[pos]} (at flat position {pos}) is outside "
        f"[0, {num_embeddings}); {bad.size} invalid id(s) in all. Use ids in "
        f"range, or invalid_ids='zero' to look them up as zero vectors."
    )
