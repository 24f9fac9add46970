"""Autodiff of the many-rows-in-flight Triton lookups: forward and backward each a chosen variant.

``kernel="auto"`` on a GPU picks the forward (``gather_rows`` / ``bag_rows``)
and the backward (``segment_rows``) separately (`gpu_choice`): either may
be XLA's ops (``None`` here) where the sweep measured those faster. So each
lookup is a ``jax.custom_vjp`` over (forward, backward): a None forward is
XLA's lookup (`xla.gather`, `bag_xla`), a None backward XLA's own gradient
(a scatter-add); a variant runs its kernel, compiled for CUDA alone
(`platforms.on_gpu`) or interpreted (``interpret``: CPU tests). A bag's weights get their gradient from XLA's
fused gather-reduce (`xla.bag_segment_sum`), as in `pallas_ad`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from embedlib.kernels import bags, platforms, xla
from embedlib.kernels import rows as rows_lib
from embedlib.kernels.bag_rows import bag_rows
from embedlib.kernels.bag_xla import bag_xla
from embedlib.kernels.gather_rows import gather_rows
from embedlib.kernels.segment_rows import segment_sum_rows
from embedlib.sharding import sum_to_varying_of


def _run(fn, interpret: bool, name: str):
  if interpret:
    return fn
  return lambda *args: platforms.on_gpu(fn, *args, name=name)


def _gather(table, ids, forward, interpret):
  if forward is None:
    return xla.gather(table, ids)
  variant = rows_lib.parse_variant(forward)
  fn = lambda t, i: gather_rows(t, i, variant=variant, interpret=interpret)
  return _run(fn, interpret, "triton rows gather")(table, ids)


def _bag(table, ids, weights, combiner, forward, interpret):
  if forward is None:
    return bag_xla(table, ids, weights, combiner=combiner)
  variant = rows_lib.parse_variant(forward)

  def fn(table, ids, *weights):
    return bag_rows(table, ids, weights[0] if weights else None, combiner=combiner,
                    variant=variant, interpret=interpret)

  return _run(fn, interpret, "triton rows bag")(table, ids,
                                                 *(() if weights is None else (weights,)))


def _table_grad(grads, src, ids, table, coef, backward, interpret):
  variant = rows_lib.parse_variant(backward)

  def fn(grads, src, ids, *coef):
    return segment_sum_rows(grads, src, ids, table.shape[0], coef=coef[0] if coef else None,
                            dtype=table.dtype, variant=variant, interpret=interpret)

  return _run(fn, interpret, "triton rows segment sum")(grads, src, ids,
                                                         *(() if coef is None else (coef,)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def gather(table, ids, forward: str | None, backward: str | None, interpret: bool):
  """``kernels.gather`` by ``forward`` (a gather variant, None: XLA), differentiated by ``backward``."""
  return _gather(table, ids, forward, interpret)


def _gather_fwd(table, ids, forward, backward, interpret):
  return _gather(table, ids, forward, interpret), (table, ids)


def _gather_bwd(forward, backward, interpret, res, g):
  table, ids = res
  if backward is None:
    _, vjp = jax.vjp(lambda t: xla.gather(t, ids), table)
    return vjp(g)[0], None
  flat = ids.reshape(-1)
  grad = _table_grad(g.reshape(-1, table.shape[1]), jnp.arange(flat.shape[0], dtype=jnp.int32),
                     flat, table, None, backward, interpret)
  return sum_to_varying_of(grad, table), None


gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def bag(table, ids, weights, combiner: str, forward: str | None, backward: str | None,
        interpret: bool):
  """``kernels.bag`` by ``forward`` (a bag variant, None: XLA), differentiated by ``backward``."""
  return _bag(table, ids, weights, combiner, forward, interpret)


def _bag_fwd(table, ids, weights, combiner, forward, backward, interpret):
  return _bag(table, ids, weights, combiner, forward, interpret), (table, ids, weights)


def _bag_bwd(combiner, forward, backward, interpret, res, g):
  table, ids, weights = res
  if backward is None:
    if weights is None:
      _, vjp = jax.vjp(lambda t: bag_xla(t, ids, None, combiner=combiner), table)
      return vjp(g)[0], None, None
    _, vjp = jax.vjp(lambda t, w: bag_xla(t, ids, w, combiner=combiner), table, weights)
    table_grad, weights_grad = vjp(g)
    return table_grad, None, weights_grad
  batch, size = ids.shape
  coef = bags.bag_coefficients(ids, weights, table.shape[0], combiner)
  table_grad = _table_grad(g, jnp.arange(batch * size, dtype=jnp.int32) // max(size, 1),
                           ids.reshape(-1), table, coef.reshape(-1), backward, interpret)
  weights_grad = None
  if weights is not None:
    _, vjp = jax.vjp(lambda w: xla.bag_segment_sum(table, ids, w, combiner=combiner), weights)
    (weights_grad,) = vjp(g)
  return sum_to_varying_of(table_grad, table), None, weights_grad


bag.defvjp(_bag_fwd, _bag_bwd)
