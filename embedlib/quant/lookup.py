"""Gather and bag of a `QuantizedTable`: the kernels of `embedlib.kernels.gather` / ``bag`` for it.

Which implementation runs is `kernels.plan`'s choice for the ``kernel=``
option, per lowering platform (`platforms.by_platform`), mapped onto the
quantized kernels:

- ``xla``: `xla.gather` of the codes and of the scales and biases,
  then `format.dequantize_rows` of the gathered rows only;
- ``cpu``: the same with the C++ row gather (`gather_cpu`, a byte copy of
  each row, any dtype) in place of XLA's;
- ``triton`` (and the Mosaic GPU options, which have no quantized kernel of
  their own): `triton.gather_triton` / `triton.bag_triton`, dequantizing
  in the kernel; interpreted on CPU (``-interpret``).

``auto`` on CUDA runs the many-rows-in-flight kernels of `bag_rows` where
the newest GPU sweep measured them faster for the format, width and bag
size (``kernels/gpu_choice.py``, dtypes ``"int8"`` / ``"int4"``).

A bag on ``xla`` / ``cpu`` pools the gathered, dequantized rows with the
float bag (`bag_xla`), which gives the float bag's arithmetic on
``dequantize(table)`` exactly. A quantized table is for inference: its
lookups have no gradient (differentiating one raises).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from embedlib.kernels import dispatch
from embedlib.kernels import platforms
from embedlib import invalid_ids
from embedlib.kernels import bags
from embedlib.kernels import xla
from embedlib.kernels.bag_pallas import check_bag_shapes
from embedlib.kernels.bag_cpu import bag_cpu
from embedlib.kernels.bag_xla import bag_xla
from embedlib.kernels.gather_cpu import gather_cpu
from embedlib import sharding as sharding_lib
from embedlib.kernels import gpu_choice
from embedlib.kernels import rows as rows_lib
from embedlib.quant import bag_rows
from embedlib.quant import format as fmt
from embedlib.quant import triton

XLA, CPU, TRITON, TRITON_INTERPRET = "xla", "cpu", "triton", "triton-interpret"
#: `kernels.plan`'s implementations -> the quantized one that stands in.
_IMPL = {
    dispatch.XLA: XLA,
    dispatch.CPU: CPU,
    dispatch.TRITON: TRITON,
    dispatch.TRITON_INTERPRET: TRITON_INTERPRET,
    dispatch.MOSAIC: TRITON,
    dispatch.MOSAIC_ORDERED: TRITON,
    dispatch.MOSAIC_INTERPRET: TRITON_INTERPRET,
}
TRAINING_ERROR = (
    "a quantized table is for inference and has no gradient; train the float module "
    "(ShardedEmbed, EmbeddingCollection or the model), then embedlib.quantize it."
)


def plan(kernel: str, interpret: bool | None = None) -> dict[str, str]:
  """The quantized implementation each platform runs (``{"cpu", "gpu", "default"}``).

  >>> plan("xla")["cpu"], plan("triton")["cpu"], plan("triton")["gpu"]
  ('xla', 'triton-interpret', 'triton')
  """
  return {p: _IMPL[impl] for p, impl in dispatch.plan(kernel, interpret).items()}


def check_vma(kernel: str = "auto", interpret: bool | None = None) -> bool:
  """``shard_map``'s ``check_vma`` for these lookups: off where the Pallas interpreter runs."""
  return TRITON_INTERPRET not in plan(kernel, interpret).values()


def _gathered(table: fmt.QuantizedTable, ids, take):
  """Float32 rows of ``ids`` (flat), gathering codes and scales with ``take``."""
  flat = ids.reshape(-1)
  data = take(table.data, flat)
  sb = None
  if table.scale_bias is not None:
    rows, blocks, _ = table.scale_bias.shape
    sb = take(table.scale_bias.reshape(rows, blocks * 2), flat).reshape(-1, blocks, 2)
  return fmt.dequantize_rows(data, sb, table.bits, table.block_width)


def _compiled_on_gpu(fn, impl: str, name: str):
  """``fn`` as is when interpreted; else lowered for CUDA alone (`platforms.on_gpu`)."""
  if impl == TRITON_INTERPRET:
    return fn
  return lambda *args: platforms.on_gpu(fn, *args, name=name)


def _empty(shape, *operands):
  """The float32 zeros of a lookup without ids, typed to vary as the operands do."""
  return sharding_lib.match_varying(jnp.zeros(shape, jnp.float32), *operands)[0]


def _gather_impl(impl: str):
  if impl == XLA:
    return lambda t, i: _gathered(t, i, xla.gather).reshape(
        i.shape + (t.shape[1],))
  if impl == CPU:
    return lambda t, i: _gathered(t, i, gather_cpu).reshape(i.shape + (t.shape[1],))
  return _compiled_on_gpu(
      lambda t, i: triton.gather_triton(t, i, interpret=impl == TRITON_INTERPRET), impl,
      "quantized gather")


def _bag_impl(impl: str):
  if impl in (XLA, CPU):
    gather = _gather_impl(impl)
    # The float kernel of the same option: the C++ bag for "cpu", bag_xla's sums for "xla".
    float_bag = bag_cpu if impl == CPU else bag_xla

    def pooled(t, ids, weights, combiner):
      # The gathered rows as a table of their own: the float kernel's sums on
      # them are its sums on the dequantized table, term by term, so a
      # quantized bag equals its float twin's bit for bit.
      rows = gather(t, ids.reshape(-1))
      valid = invalid_ids.valid_mask(ids, t.shape[0])
      local = jnp.where(valid, jnp.arange(ids.size, dtype=jnp.int32).reshape(ids.shape), -1)
      return float_bag(rows, local, weights, combiner=combiner)

    return pooled
  return lambda t, ids, weights, combiner: _compiled_on_gpu(
      lambda t, i, *w: triton.bag_triton(t, i, *(w or (None,)), combiner=combiner,
                                         interpret=impl == TRITON_INTERPRET),
      impl, "quantized bag")(t, ids, *(() if weights is None else (weights,)))


@jax.custom_jvp
def _no_gradient(x):
  return x


@_no_gradient.defjvp
def _no_gradient_jvp(primals, tangents):
  raise ValueError(f"embedlib.quantize: {TRAINING_ERROR}")


def _check_ids(name, ids):
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(
        f"{name}: ids must be integers, got {ids.dtype}; cast with ids.astype(jnp.int32).")


def gather(table: fmt.QuantizedTable, ids, *, kernel: str = "auto", interpret: bool | None = None):
  """``dequantize(table)[ids]`` with zero rows for invalid ids, dequantizing only those rows.

  Args:
    table: a `QuantizedTable` (a local shard inside ``shard_map``); a float
      table (rows a strategy already gathered) takes `kernels.gather`.
    ids: int array of any shape; ids outside ``[0, rows)`` read zeros.
    kernel: one of ``options.KERNELS`` (see `plan`).
    interpret: Pallas interpreter on (True), off (False) or on CPU only (None).

  Returns:
    float32 ``ids.shape + (columns,)``.

  >>> import numpy as np, jax.numpy as jnp
  >>> q = fmt.quantize_table(np.arange(6.0).reshape(3, 2), bits=8)
  >>> gather(q, jnp.array([2, -1]), kernel="pallas").tolist()
  [[4.0, 5.0], [0.0, 0.0]]
  """
  if not fmt.is_quantized(table):  # rows already gathered (a routed lookup's exchange)
    return dispatch.gather(table, ids, kernel=kernel, interpret=interpret)
  _check_ids("quantized gather", ids)
  if ids.size == 0:
    return _empty(ids.shape + (table.shape[1],), *jax.tree.leaves(table), ids)
  branches = _branches(_gather_impl, kernel, interpret)
  variant = _measured("gather", table, kernel)
  if variant is not None:
    branches["gpu"] = lambda t, i: platforms.on_gpu(
        lambda t, i: bag_rows.gather_rows(t, i, variant=variant), t, i,
        name="quantized rows gather")
  return _no_gradient(platforms.by_platform(table, ids, **branches))


def bag(table: fmt.QuantizedTable, ids, weights=None, *, combiner: str = "sum",
        kernel: str = "auto", interpret: bool | None = None):
  """Pooled bags of ``dequantize(table)`` (`kernels.bag`'s semantics), dequantizing only their rows.

  Args:
    table: a `QuantizedTable`; a float table takes `kernels.bag`.
    ids: int ``[batch, bag]`` padded with -1 (any invalid id is padding).
    weights: optional float ``[batch, bag]``.
    combiner: ``"sum"``, ``"mean"`` or ``"sqrtn"``.
    kernel: one of ``options.KERNELS``.
    interpret: as in `gather`.

  Returns:
    float32 ``[batch, columns]``.

  >>> import numpy as np, jax.numpy as jnp
  >>> q = fmt.quantize_table(np.arange(6.0).reshape(3, 2), bits=8)
  >>> bag(q, jnp.array([[0, 2, -1]]), combiner="mean", kernel="xla").tolist()
  [[2.0, 3.0]]
  """
  if not fmt.is_quantized(table):  # rows already gathered (a routed lookup's exchange)
    return dispatch.bag(table, ids, weights, combiner=combiner, kernel=kernel,
                        interpret=interpret)
  _check_ids("quantized bag", ids)
  bags.check_combiner(combiner)
  check_bag_shapes(ids, weights)
  if ids.size == 0:
    return _empty(ids.shape[:1] + (table.shape[1],), *jax.tree.leaves(table), ids,
                  *(() if weights is None else (weights,)))
  branches = _branches(_bag_impl, kernel, interpret, combiner=combiner)
  variant = _measured("bag", table, kernel, bag=ids.shape[1])
  if variant is not None:
    branches["gpu"] = lambda t, i, w: platforms.on_gpu(
        lambda t, i, *w: bag_rows.bag_rows(t, i, *(w or (None,)), combiner=combiner,
                                           variant=variant),
        t, i, *(() if w is None else (w,)), name="quantized rows bag")
  return _no_gradient(platforms.by_platform(table, ids, weights, **branches))


def _measured(kind, table, kernel, bag=0):
  """The `bag_rows` variant ``auto`` runs on CUDA for this table (`gpu_choice`), or None."""
  if kernel != "auto" or not bag_rows.supports(table):
    return None
  dtype = "int8" if table.bits == fmt.INT8 else "int4"
  name = gpu_choice.choose(kind, table.shape[1], dtype, bag=bag)
  if name is None or not name.startswith(gpu_choice.RUNNABLE):
    return None
  return rows_lib.parse_variant(name)


def _branches(make, kernel, interpret, **kw):
  """One function per platform, shared where the implementation is (`platforms.by_platform`)."""
  chosen = plan(kernel, interpret)
  made = {impl: functools.partial(make(impl), **kw) for impl in set(chosen.values())}
  return {p: made[impl] for p, impl in chosen.items()}
