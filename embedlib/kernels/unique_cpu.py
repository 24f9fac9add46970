"""Distinct ids with their inverse on CPU as a C++ kernel (``cpu/unique.cc``).

``strategies.unique.unique_with_inverse`` is one sort of the ids and a binary
search: on a GPU that is cheap, but XLA:CPU's sort calls a comparator per
comparison, and dedup then cost several times the lookup it serves. The
kernel finds the same distinct ids without sorting the ids (a mark per
possible id, or a hash table when the ids are spread over a far larger
range) and returns the same three arrays, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedlib.kernels import cpu_library


def unique_cpu(flat: jax.Array, capacity: int):
  """``unique_with_inverse`` of flat int32 ids, through the C++ kernel.

  Args:
    flat: int32 ``[n]``; negative ids are padding.
    capacity: static number of unique slots.

  Returns:
    ``(unique [capacity] int32 increasing, padded with -1; inverse [n]
    int32, -1 at negative ids and >= capacity at ids past it; count []
    int32)``.

  Raises:
    RuntimeError: without the CPU kernels' library (``cpu_library.call``).
  """
  results = [
      jax.ShapeDtypeStruct((capacity,), jnp.int32),
      jax.ShapeDtypeStruct(flat.shape, jnp.int32),
      jax.ShapeDtypeStruct((), jnp.int32),
  ]
  unique, inverse, count = cpu_library.call("embedlib_unique", results, flat)
  return unique, inverse, count
