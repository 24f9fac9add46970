"""Pooled bags on CPU as a C++ kernel (``cpu/bag.cc``), differentiated as `bag_xla`.

`bag_cpu` is ``kernel="cpu"``'s bag (`dispatch`). For a float32 table every
bag, single-hot (one id a row, most of a DLRM's) or multi-hot, goes through
the kernel: each bag's rows summed in registers, fetched a few ids ahead,
the bags split over XLA's intra-op threads, where `bag_xla`'s fused loop
gathers a row at a time and recomputes the invalid-id masks per element
(``benchmarks/collection_lookup.py`` times the collection on it beside
FBGEMM's and TorchRec's CPU kernels). Unweighted bags' factors (``1``,
``1 / n``, ``1 / sqrt(n)``) are made in the kernel; weighted ones come from
`bags.bag_coefficients`. Its terms are `xla.bag_segment_sum`'s rounded
products added slot by slot from zero, so the result is the segment sum's;
`bag_xla`'s equals it up to where XLA fuses a multiply and an add (an ulp).

Its gradients are `bag_xla`'s backward (one scatter-add into the table, and
the factors' gradient), which the sparse optimizers never run: they take
row gradients from the tape. Other table dtypes take the C++ gather times
the factor for a single-hot bag (`gather_cpu`), else `bag_xla`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from embedlib import invalid_ids, options
from embedlib.kernels import bag_xla as bag_xla_lib
from embedlib.kernels import bags, cpu_library
from embedlib.kernels.gather_cpu import gather_cpu

#: Unweighted bags without factors: an empty ``coef`` operand.
_NO_COEF = np.zeros((0,), np.float32)


def _ids32(ids: jax.Array, num_embeddings: int) -> jax.Array:
  """int32 ids, invalid ones ``-1`` (a wider id would wrap into range)."""
  if ids.dtype == jnp.int32:
    return ids
  return jnp.where(invalid_ids.valid_mask(ids, num_embeddings), ids, -1).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pooled(table, ids, coef, combiner):
  """The kernel's ``[batch, features]``: factors ``coef``, or the combiner's when it is empty."""
  result = jax.ShapeDtypeStruct((ids.shape[0], table.shape[1]), jnp.float32)
  (out,) = cpu_library.call("embedlib_bag", [result], table, ids, coef,
                            combiner=np.int64(options.COMBINERS.index(combiner)))
  return out


def _pooled_fwd(table, ids, coef, combiner):
  return _pooled(table, ids, coef, combiner), (table, ids, coef)


def _pooled_bwd(combiner, res, g):
  table, ids, coef = res
  n = table.shape[0]
  full = coef if coef.size else bags.bag_coefficients(ids, None, n, combiner)
  table_grad, _, coef_grad = bag_xla_lib.pooled_bwd(
      (table, bag_xla_lib.out_of_range(ids, n), full), g)
  return table_grad, None, coef_grad if coef.size else jnp.zeros_like(coef)


_pooled.defvjp(_pooled_fwd, _pooled_bwd)


def bag_cpu(table, ids, weights=None, *, combiner="sum"):
  """`xla.bag_segment_sum`'s result through the C++ kernels (module docstring).

  Same arguments, result and gradients as `kernels.bag_reference`.

  >>> import jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> bag_cpu(table, jnp.array([[0, 2, -1], [-1, -1, -1]]), combiner="mean").tolist()
  [[2.0, 3.0], [0.0, 0.0]]
  """
  n = table.shape[0]
  if table.dtype == jnp.float32 and ids.shape[1] > 0:
    coef = _NO_COEF if weights is None else bags.bag_coefficients(ids, weights, n, combiner)
    return _pooled(table, _ids32(ids, n), coef, combiner)
  if ids.shape[1] == 1:
    coef = bags.bag_coefficients(ids, weights, n, combiner)
    rows = gather_cpu(table, ids[:, 0])
    return (rows.astype(jnp.float32) * coef[:, 0, None]).astype(table.dtype)
  return bag_xla_lib.bag_xla(table, ids, weights, combiner=combiner)
