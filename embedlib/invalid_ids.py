"""The one rule for invalid ids, shared by every strategy and kernel.

An id is valid when ``0 <= id < num_embeddings``. By default an invalid id
looks up a zero vector and gets no gradient (``-1`` is the usual padding id
of recommender batches). ``nnx.Embed`` differs: it returns NaN rows for ids
past the end and wraps negative ids (numpy indexing). With
``invalid_ids="error"`` an invalid id is an error that names it and the
table size: raised at once for concrete ids, and through
``jax.experimental.checkify`` when the lookup is traced (wrap the jitted
function in ``checkify.checkify`` to get the error back).

Ids of every integer dtype follow the rule. The range test never runs in a
dtype that can't hold ``num_embeddings`` (int8 ids of a 40,000-row table are
all in range once non-negative), and 64-bit host ids (numpy, Python ints)
are tested on the host in full precision before JAX sees them: with x64 off
JAX would keep only their low 32 bits, turning ``2**32 + 5`` into row 5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

ZERO = "zero"
ERROR = "error"
MODES = (ZERO, ERROR)


def valid_mask(ids, num_embeddings: int):
  """``0 <= ids < num_embeddings``, exact for every integer dtype.

  Works on numpy and JAX arrays alike. The bound is compared in the ids'
  own dtype only when that dtype can hold it, so it can't overflow.

  >>> valid_mask(np.array([1, 100, -1], np.int8), 40_000).tolist()
  [True, True, False]
  >>> valid_mask(jnp.array([200, 7], jnp.uint8), 100).tolist()
  [False, True]
  """
  dtype = np.dtype(ids.dtype)
  info = np.iinfo(dtype)
  valid = ids >= 0 if info.min < 0 else (ids == ids)
  if info.max >= num_embeddings:
    valid = valid & (ids < np.asarray(num_embeddings, dtype))
  return valid


def as_ids(x, num_embeddings: int):
  """Brings ids of any integer dtype to an array JAX holds without loss.

  JAX arrays and tracers are returned unchanged (JAX has already fixed
  their dtype). Host ids that JAX would narrow (64-bit ids with x64 off)
  are range-tested here in full precision and handed over as int32, with
  every invalid id (including one past int32's range) set to ``-1``.
  Anything else, non-integers included, is returned as ``jnp.asarray``
  gives it, for the caller's own checks.

  >>> as_ids(np.array([2**32 + 5, 3], np.int64), 10).tolist()
  [-1, 3]
  """
  if isinstance(x, jax.Array):
    return x
  host = np.asarray(x)
  if (
      host.dtype.kind in "iu"
      and host.dtype.itemsize == 8
      and not jax.config.jax_enable_x64
  ):
    # Cast before the select, in numpy: -1 is no uint64 (numpy >= 2.5 raises).
    return jnp.asarray(np.where(valid_mask(host, num_embeddings), host.astype(np.int32), np.int32(-1)))
  return jnp.asarray(host)


def sanitize(ids, num_embeddings: int):
  """Maps every invalid id to ``-1`` and returns int32 ids.

  >>> sanitize(jnp.array([0, 4, 5, -3]), 5)
  Array([ 0,  4, -1, -1], dtype=int32)
  >>> sanitize(jnp.array([1, 30000], jnp.int16), 40_000)
  Array([    1, 30000], dtype=int32)
  """
  # Cast before the select: valid ids fit int32 exactly, invalid ones are
  # replaced whatever the cast made of them.
  return jnp.where(valid_mask(ids, num_embeddings), ids.astype(jnp.int32), -1)


def _allowed(ids, num_embeddings, padding):
  valid = valid_mask(ids, num_embeddings)
  if padding and np.iinfo(np.dtype(ids.dtype)).min < 0:
    valid = valid | (ids == -1)
  return valid


def check(ids, num_embeddings: int, name: str, *, padding: bool = False) -> None:
  """Raises if any id is outside ``[0, num_embeddings)``.

  Host ids are checked in full precision; call it before ``as_ids``.
  ``padding``: ``-1`` is a bag's padding, not an invalid id.

  >>> check(jnp.array([1, 7]), 5, "user_id")
  Traceback (most recent call last):
  ...
  IndexError: user_id: id 7 (at flat position 1) is outside [0, 5); ...
  """
  if np.size(ids) == 0:  # nothing to check (and a split empty array can't be flattened)
    return
  if isinstance(ids, jax.core.Tracer):
    valid = _allowed(ids, num_embeddings, padding)
    # The first invalid id, by reductions only: indexing a sharded array
    # with a traced position needs its output sharding spelled out.
    flat, ok = ids.reshape(-1), valid.reshape(-1)
    pos = jnp.arange(flat.shape[0])
    first = jnp.min(jnp.where(ok, flat.shape[0], pos), initial=flat.shape[0])
    bad = jnp.sum(jnp.where(pos == first, flat, 0))
    checkify.check(
        jnp.all(valid),
        f"{name}: id {{bad}} is outside [0, {num_embeddings}); use ids in "
        "range, or invalid_ids='zero' to look them up as zero vectors.",
        bad=bad,
    )
    return
  flat = np.asarray(ids).reshape(-1)
  bad = np.flatnonzero(~_allowed(flat, num_embeddings, padding))
  if bad.size:
    pos = int(bad[0])
    raise IndexError(
        f"{name}: id {flat[pos]} (at flat position {pos}) is outside "
        f"[0, {num_embeddings}); {bad.size} invalid id(s) in all. Use ids in "
        f"range, or invalid_ids='zero' to look them up as zero vectors."
    )
