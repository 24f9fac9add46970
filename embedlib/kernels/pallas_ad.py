"""Autodiff of the Pallas lookups: each a ``jax.custom_vjp``, for either backend and any mode.

A ``pallas_call`` has no autodiff, so the gather and the bag of each
backend (``"mosaic"``: `gather_mosaic`, `bag_mosaic`, `backward_mosaic`;
``"triton"``: `gather_pallas`, `bag_pallas`, `backward`) are wrapped here:
the forward runs the backend's kernel, the backward its deterministic
segment sum of the row gradients into the table gradient (no colliding
scatter-add). A bag's weights get their gradient from XLA's fused
gather-reduce of `xla.bag_segment_sum` (``<g[b], row[b, l]>`` per slot).

``mode`` says how the kernels run: ``INTERPRET`` (Pallas's or Mosaic GPU's
interpreter, any platform), ``COMPILED`` (CUDA only: `platforms.on_gpu`),
or ``BESIDE_INTERPRETER`` (compiled, in a ``platform_dependent`` whose CPU
branch interprets the Mosaic kernels: it declares the interpreter's
ordered effect, see `platforms`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from embedlib.kernels import platforms
from embedlib.kernels import bags
from embedlib.kernels import xla
from embedlib.kernels.backward import segment_sum_rows
from embedlib.kernels.backward_mosaic import segment_sum_mosaic
from embedlib.kernels.bag_mosaic import bag_mosaic
from embedlib.kernels.bag_pallas import bag_pallas
from embedlib.kernels.gather_mosaic import gather_mosaic
from embedlib.kernels.gather_pallas import gather_pallas
from embedlib.sharding import sum_to_varying_of

INTERPRET, COMPILED, BESIDE_INTERPRETER = "interpret", "compiled", "beside-interpreter"


def _run(fn, mode: str, name: str):
  """``fn`` as is when interpreted; lowered for CUDA alone when compiled."""
  if mode == INTERPRET:
    return fn
  ordered = mode == BESIDE_INTERPRETER
  return lambda *args: platforms.on_gpu(fn, *args, name=name, ordered=ordered)


def _gather_kernel(backend, table, ids, mode):
  kernel = gather_mosaic if backend == "mosaic" else gather_pallas
  fn = lambda t, i: kernel(t, i, interpret=mode == INTERPRET)
  return _run(fn, mode, f"{backend} gather")(table, ids)


def _bag_kernel(backend, table, ids, weights, combiner, mode):
  interpret = mode == INTERPRET
  if backend == "mosaic":
    # The kernel sums scaled rows; the combiner's coefficients are XLA's.
    coef = bags.bag_coefficients(ids, weights, table.shape[0], combiner)
    fn = lambda t, i, c: bag_mosaic(t, i, c, interpret=interpret)
    return _run(fn, mode, "mosaic bag")(table, ids, coef)

  def fn(table, ids, *weights):
    return bag_pallas(table, ids, weights[0] if weights else None, combiner=combiner,
                      interpret=interpret)

  return _run(fn, mode, "triton bag")(table, ids, *(() if weights is None else (weights,)))


def _segment_sum(backend, grads, src, ids, num_embeddings, coef, dtype, mode):
  """``out[r] = sum_{j: ids[j] == r} coef[j] * grads[src[j]]`` by ``backend``'s kernel."""
  kernel = segment_sum_mosaic if backend == "mosaic" else segment_sum_rows

  def fn(grads, src, ids, *coef):
    return kernel(grads, src, ids, num_embeddings, coef=coef[0] if coef else None, dtype=dtype,
                  interpret=mode == INTERPRET)

  return _run(fn, mode, f"{backend} segment sum")(grads, src, ids,
                                                   *(() if coef is None else (coef,)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def gather(table, ids, backend: str, mode: str):
  """``kernels.gather`` by ``backend``'s kernels in ``mode``: the forward and its custom VJP."""
  return _gather_kernel(backend, table, ids, mode)


def _gather_fwd(table, ids, backend, mode):
  return _gather_kernel(backend, table, ids, mode), (table, ids)


def _gather_bwd(backend, mode, res, g):
  table, ids = res
  flat = ids.reshape(-1)
  grad = _segment_sum(
      backend, g.reshape(-1, table.shape[1]), jnp.arange(flat.shape[0], dtype=jnp.int32), flat,
      table.shape[0], None, table.dtype, mode,
  )
  return sum_to_varying_of(grad, table), None


gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def bag(table, ids, weights, combiner: str, backend: str, mode: str):
  """``kernels.bag`` by ``backend``'s kernels in ``mode``: the forward and its custom VJP."""
  return _bag_kernel(backend, table, ids, weights, combiner, mode)


def _bag_fwd(table, ids, weights, combiner, backend, mode):
  return _bag_kernel(backend, table, ids, weights, combiner, mode), (table, ids, weights)


def _bag_bwd(combiner, backend, mode, res, g):
  table, ids, weights = res
  batch, bag_size = ids.shape
  coef = bags.bag_coefficients(ids, weights, table.shape[0], combiner)
  table_grad = _segment_sum(
      backend, g, jnp.arange(batch * bag_size, dtype=jnp.int32) // max(bag_size, 1),
      ids.reshape(-1), table.shape[0], coef.reshape(-1), table.dtype, mode,
  )
  weights_grad = None
  if weights is not None:
    _, vjp = jax.vjp(lambda w: xla.bag_segment_sum(table, ids, w, combiner=combiner), weights)
    (weights_grad,) = vjp(g)
  return sum_to_varying_of(table_grad, table), None, weights_grad


bag.defvjp(_bag_fwd, _bag_bwd)
