"""Row gather on CPU as a C++ kernel (``cpu/gather.cc``), differentiated as XLA's.

XLA's CPU gather copies one row at a time and waits on each row's cache
misses; the kernel fetches rows ahead on XLA's intra-op threads (``benchmarks/lookup.py``
times the two side by side). The result is `xla.gather`'s bit for bit (a
byte copy of each row, zeros for invalid ids), and its gradient is
`xla.gather`'s own (jax's transpose of it: a scatter-add),
so only the forward differs from ``kernel="xla"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedlib import invalid_ids
from embedlib.kernels import cpu_library
from embedlib.kernels import xla


def _ids32(ids: jax.Array, num_embeddings: int) -> jax.Array:
  """Flat int32 ids, invalid ones ``-1`` (a wider id would wrap into range)."""
  flat = ids.reshape(-1)
  if flat.dtype == jnp.int32:
    return flat
  return jnp.where(invalid_ids.valid_mask(flat, num_embeddings), flat, -1).astype(jnp.int32)


def _forward(table: jax.Array, ids: jax.Array) -> jax.Array:
  flat = _ids32(ids, table.shape[0])
  result = jax.ShapeDtypeStruct((flat.shape[0], table.shape[1]), table.dtype)
  (rows,) = cpu_library.call("embedlib_gather", [result], table, flat)
  return rows.reshape(ids.shape + (table.shape[1],))


@jax.custom_vjp
def gather_cpu(table: jax.Array, ids: jax.Array) -> jax.Array:
  """``table[ids]`` with zero rows for invalid ids: `xla.gather` on CPU.

  Args:
    table: ``[num_embeddings, features]``, any float dtype.
    ids: int array of any shape; ids outside ``[0, num_embeddings)`` read zeros.

  Returns:
    ``ids.shape + (features,)`` in ``table.dtype``.

  Raises:
    RuntimeError: without the CPU kernels' library (``cpu_library.require``).
  """
  return _forward(table, ids)


def _fwd(table, ids):
  return _forward(table, ids), (table, ids)


def _bwd(res, g):
  table, ids = res
  _, vjp = jax.vjp(lambda t: xla.gather(t, ids), table)
  return vjp(g)[0], None


gather_cpu.defvjp(_fwd, _bwd)

