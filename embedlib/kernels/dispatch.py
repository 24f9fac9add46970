"""Public lookups: which kernel runs on which platform, and autodiff.

A ``kernel=`` option names a family; `plan` turns it into one
implementation per platform (CPU, CUDA, any other), and `gather` / `bag`
stage all of them with ``lax.platform_dependent`` (`platforms.by_platform`),
so the platform a program is *lowered* for picks its kernel, whatever
machine traced it. Implementations:

- ``"xla"``: the pure-jnp gather reference (differentiated by jax) and
  `bag_xla` (the reference's sums slot by slot, a hand-written backward);
- ``"cpu"``: the C++ gather of `gather_cpu` (the reference's gradient),
  `bag_xla` for bags;
- ``"mosaic"``: the Mosaic GPU kernels (`gather_mosaic`, `bag_mosaic`,
  `backward_mosaic`), compiled (CUDA only, through `platforms.on_gpu`) or
  run by Mosaic GPU's interpreter (``"mosaic-interpret"``, jax >= 0.11);
- ``"triton"``: the Triton Pallas kernels, compiled or run by the Pallas
  interpreter (``"triton-interpret"``, any platform).

A kernel has no autodiff, so each Pallas lookup is a ``jax.custom_vjp``
whose backward is a deterministic segment sum (no colliding scatter-add).
A table the Mosaic kernels do not take (rows not whole 16-byte units,
`mosaic.supports`) runs the XLA ops instead, as does a shape listed in
`gpu_choice` for ``"auto"``.

Options: ``"xla"`` everywhere; ``"cpu"`` is the C++ gather on CPU and XLA
elsewhere; ``"mosaic"`` and ``"triton"`` name a Pallas backend, compiled on
CUDA and interpreted on CPU (``interpret=True`` / ``False`` forces one of
them on every platform; jax 0.10 has no Mosaic interpreter, so its CPU runs
XLA there); ``"pallas"`` is the backend of this jax (`pallas_backend`:
Mosaic GPU from jax 0.11, where JAX deprecates Triton; Triton on 0.10);
``"auto"`` is ``"pallas"`` compiled on CUDA, the C++ gather on CPU where
its library builds (`cpu_library.available`), and XLA elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from embedlib import options
from embedlib.kernels import cpu_library
from embedlib.kernels import gpu_choice
from embedlib.kernels import mosaic
from embedlib.kernels import platforms
from embedlib.kernels import reference
from embedlib.kernels.backward import segment_sum_rows
from embedlib.kernels.backward_mosaic import segment_sum_mosaic
from embedlib.kernels.bag_mosaic import bag_mosaic
from embedlib.kernels.bag_pallas import bag_pallas, check_bag_shapes
from embedlib.kernels.bag_xla import bag_xla
from embedlib.kernels.gather_cpu import gather_cpu
from embedlib.kernels.gather_mosaic import gather_mosaic
from embedlib.kernels.gather_pallas import gather_pallas
from embedlib.sharding import sum_to_varying_of

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
#: Implementations `plan` chooses from.
XLA, CPU = "xla", "cpu"
MOSAIC, MOSAIC_INTERPRET = "mosaic", "mosaic-interpret"
#: The compiled Mosaic kernels in a program whose CPU branch interprets them:
#: they declare the interpreter's ordered effect (`platforms.on_gpu`).
MOSAIC_ORDERED = "mosaic-ordered"
TRITON, TRITON_INTERPRET = "triton", "triton-interpret"


def pallas_backend() -> str:
  """What ``kernel="pallas"`` names on this jax: ``"mosaic"`` (jax >= 0.11), else ``"triton"``.

  Keyed on Mosaic GPU's interpreter, which arrived with the deprecation of
  the Triton backend: without it the CPU could not run the Mosaic kernels.
  """
  return MOSAIC if mosaic.has_interpreter() else TRITON


def target_platform() -> str:
  """The platform a trace is most likely for: the abstract mesh's device if set, else the default backend.

  Only for reporting (`resolve_kernel`): the lookups themselves choose per
  lowering platform.

  >>> target_platform()
  'cpu'
  """
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh is None or mesh.empty else getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "platform", None):
    return device.platform
  return jax.default_backend()


def check_kernel(kernel: str) -> None:
  """Raises ValueError unless ``kernel`` is one of ``options.KERNELS``."""
  if kernel not in options.KERNELS:
    raise ValueError(
        f"kernel={kernel!r} is not a lookup kernel; use one of {options.KERNELS} "
        "('auto' picks the Pallas kernels on GPU, the C++ gather on CPU where "
        "its library builds, and XLA elsewhere)."
    )


def plan(kernel: str, interpret: bool | None = None) -> dict[str, str]:
  """The implementation each platform runs for a ``kernel`` option.

  Args:
    kernel: one of ``options.KERNELS``.
    interpret: None (the interpreter on CPU, compiled on GPU), True (the
      interpreter everywhere) or False (compiled everywhere: CUDA only).

  Returns:
    ``{"cpu": impl, "gpu": impl, "default": impl}``; the GPU entry is what
    CUDA runs, the default what any other platform runs.

  >>> plan("auto")["gpu"] == pallas_backend(), plan("xla")["cpu"]
  (True, 'xla')
  """
  check_kernel(kernel)
  if kernel == "xla":
    return {"cpu": XLA, "gpu": XLA, "default": XLA}
  cpu_gather = CPU if cpu_library.available() else XLA
  if kernel == "cpu":
    return {"cpu": cpu_gather, "gpu": XLA, "default": XLA}
  if kernel == "auto":
    return {"cpu": cpu_gather, "gpu": pallas_backend(), "default": XLA}
  compiled = pallas_backend() if kernel == "pallas" else kernel
  interpreted = compiled + "-interpret"
  if compiled == MOSAIC and not mosaic.has_interpreter():
    interpreted = XLA  # jax 0.10: no Mosaic GPU interpreter
  if interpret is None:
    if interpreted == MOSAIC_INTERPRET:
      compiled = MOSAIC_ORDERED
    return {"cpu": interpreted, "gpu": compiled, "default": XLA}
  chosen = interpreted if interpret else compiled
  return {"cpu": chosen, "gpu": chosen, "default": chosen}


def resolve_kernel(kernel: str, platform: str | None = None) -> str:
  """The implementation ``kernel`` runs on ``platform`` (default: `target_platform`).

  Also the check of a kernel name (``ShardedEmbed`` calls it to fail early).

  >>> resolve_kernel("triton", "cuda"), resolve_kernel("xla")
  ('triton', 'xla')
  """
  chosen = plan(kernel)
  platform = target_platform() if platform is None else platform
  if platform == "cpu":
    return chosen["cpu"]
  return chosen["gpu"] if platform in _GPU_PLATFORMS else chosen["default"]


def shard_map_check_vma(kernel: str = "auto", interpret: bool | None = None) -> bool:
  """The ``check_vma`` to give a ``jax.shard_map`` whose body calls these lookups.

  False exactly when some platform's branch runs the Pallas *interpreter*
  on the Triton kernels: it evaluates the kernel body with ordinary
  primitives, and those reject the kernel's own index arithmetic (not
  varying) meeting a sharded table (varying) -- the error text itself
  suggests ``check_vma=False`` (seen on jax 0.10.2 and 0.12). The program
  holds every platform's branch, so the answer is the same whichever
  platform it is lowered for. Compiled kernels, and Mosaic GPU's
  interpreter (which runs its own simulation), work with ``check_vma=True``
  and declare their outputs' varying axes for it.

  >>> shard_map_check_vma("xla"), shard_map_check_vma("triton"), shard_map_check_vma("auto")
  (True, False, True)
  """
  return TRITON_INTERPRET not in plan(kernel, interpret).values()


def _check_operands(name: str, table: jax.Array, ids: jax.Array) -> None:
  if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
    raise ValueError(
        f"{name}: table must be a float [num_embeddings, features] array, got "
        f"{table.dtype}{list(table.shape)}; reshape or cast the table."
    )
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(
        f"{name}: ids must be integers, got {ids.dtype}; cast with ids.astype(jnp.int32)."
    )


def _compiled(fn, interpret, name: str):
  """``fn`` as is for the interpreter; lowered for CUDA alone when compiled.

  ``interpret``: True, False, or ``MOSAIC_ORDERED`` (compiled, declaring the
  interpreter's ordered effect).
  """
  if interpret is True:
    return fn
  ordered = interpret == MOSAIC_ORDERED
  return lambda *args: platforms.on_gpu(fn, *args, name=name, ordered=ordered)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_ad(table, ids, interpret):
  return _triton_gather(table, ids, interpret)


def _triton_gather(table, ids, interpret):
  fn = lambda t, i: gather_pallas(t, i, interpret=interpret)
  return _compiled(fn, interpret, "embedlib_gather")(table, ids)


def _gather_fwd(table, ids, interpret):
  return _triton_gather(table, ids, interpret), (table, ids)


def _triton_segment_sum(grads, src, ids, num_embeddings, coef, dtype, interpret):
  def fn(grads, src, ids, *coef):
    return segment_sum_rows(grads, src, ids, num_embeddings, coef=coef[0] if coef else None,
                            dtype=dtype, interpret=interpret)

  operands = (grads, src, ids) + (() if coef is None else (coef,))
  return _compiled(fn, interpret, "embedlib_segment_sum")(*operands)


def _gather_bwd(interpret, res, g):
  table, ids = res
  features = table.shape[1]
  flat = ids.reshape(-1)
  grad = _triton_segment_sum(
      g.reshape(-1, features), jnp.arange(flat.shape[0], dtype=jnp.int32), flat,
      table.shape[0], None, table.dtype, interpret,
  )
  return sum_to_varying_of(grad, table), None


_gather_ad.defvjp(_gather_fwd, _gather_bwd)


def _mosaic(fn, mode, name):
  return _compiled(fn, mode, name)


# ``mode`` of the Mosaic custom_vjps: True (interpreted), False (compiled) or
# MOSAIC_ORDERED (compiled, beside the interpreter).


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mosaic_gather_ad(table, ids, mode):
  fn = lambda t, i: gather_mosaic(t, i, interpret=mode is True)
  return _mosaic(fn, mode, "embedlib_gather_mosaic")(table, ids)


def _mosaic_gather_fwd(table, ids, mode):
  return _mosaic_gather_ad(table, ids, mode), (table, ids)


def _mosaic_segment_sum(grads, src, ids, num_embeddings, coef, dtype, mode):
  def fn(grads, src, ids, coef):
    return segment_sum_mosaic(grads, src, ids, num_embeddings, coef=coef, dtype=dtype,
                              interpret=mode is True)

  if coef is None:
    coef = jnp.ones(ids.shape, jnp.float32)
  return _mosaic(fn, mode, "embedlib_segment_sum_mosaic")(grads, src, ids, coef)


def _mosaic_gather_bwd(interpret, res, g):
  table, ids = res
  flat = ids.reshape(-1)
  grad = _mosaic_segment_sum(
      g.reshape(-1, table.shape[1]), jnp.arange(flat.shape[0], dtype=jnp.int32), flat,
      table.shape[0], None, table.dtype, interpret,
  )
  return sum_to_varying_of(grad, table), None


_mosaic_gather_ad.defvjp(_mosaic_gather_fwd, _mosaic_gather_bwd)


def _shape_checked(pallas_fn, kind):
  """``pallas_fn``, or the XLA ops for a table the Mosaic kernels do not take."""

  def run(table, ids, *rest):
    if not mosaic.supports(table.shape, table.dtype):
      return _XLA[kind](table, ids, *rest)
    return pallas_fn(table, ids, *rest)

  return run


def _auto_checked(pallas_fn, kind):
  """``pallas_fn``, or the XLA ops where `gpu_choice` lists the shape as faster in XLA."""

  def run(table, ids, *rest):
    if gpu_choice.prefers_xla(kind, table.shape, table.dtype, ids.shape):
      return _XLA[kind](table, ids, *rest)
    return pallas_fn(table, ids, *rest)

  return run


_GATHERS = {
    XLA: reference.gather_reference,
    CPU: gather_cpu,
    TRITON: lambda t, i: _gather_ad(t, i, False),
    TRITON_INTERPRET: lambda t, i: _gather_ad(t, i, True),
    MOSAIC: lambda t, i: _mosaic_gather_ad(t, i, False),
    MOSAIC_ORDERED: lambda t, i: _mosaic_gather_ad(t, i, MOSAIC_ORDERED),
    MOSAIC_INTERPRET: lambda t, i: _mosaic_gather_ad(t, i, True),
}
for _impl in (MOSAIC, MOSAIC_ORDERED, MOSAIC_INTERPRET):
  _GATHERS[_impl] = _shape_checked(_GATHERS[_impl], "gather")
_AUTO_GATHER = _auto_checked(_GATHERS[pallas_backend()], "gather")


def gather(table: jax.Array, ids: jax.Array, *, kernel: str = "auto", interpret: bool | None = None):
  """Row lookup ``table[ids]`` with zero rows (and no gradient) for invalid ids.

  Args:
    table: ``[num_embeddings, features]``, any float dtype (a local shard
      inside ``jax.shard_map``).
    ids: int array of any shape; ids outside ``[0, num_embeddings)`` read
      zeros.
    kernel: one of ``options.KERNELS`` (see `plan`).
    interpret: Pallas interpreter on (True), off (False) or on CPU only (None).

  Returns:
    ``ids.shape + (features,)`` in ``table.dtype``. Differentiable w.r.t.
    ``table``; the Pallas path's gradient is a deterministic segment sum.

  >>> import jax, jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> gather(table, jnp.array([1, 5]), kernel="pallas").tolist()
  [[2.0, 3.0], [0.0, 0.0]]
  >>> jax.grad(lambda t: gather(t, jnp.array([1, 1, -1]), kernel="pallas").sum())(table).tolist()
  [[0.0, 0.0], [2.0, 2.0], [0.0, 0.0]]
  """
  _check_operands("gather", table, ids)
  chosen = plan(kernel, interpret)
  branches = {p: _GATHERS[impl] for p, impl in chosen.items()}
  if kernel == "auto":
    branches["gpu"] = _AUTO_GATHER
  return platforms.by_platform(table, ids, **branches)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _bag_ad(table, ids, weights, combiner, interpret):
  return _triton_bag(table, ids, weights, combiner, interpret)


def _triton_bag(table, ids, weights, combiner, interpret):
  def fn(table, ids, *weights):
    return bag_pallas(table, ids, weights[0] if weights else None, combiner=combiner,
                      interpret=interpret)

  operands = (table, ids) + (() if weights is None else (weights,))
  return _compiled(fn, interpret, "embedlib_bag")(*operands)


def _bag_fwd(table, ids, weights, combiner, interpret):
  out = _triton_bag(table, ids, weights, combiner, interpret)
  return out, (table, ids, weights)


def _bag_bwd(combiner, interpret, res, g):
  table, ids, weights = res
  num_embeddings = table.shape[0]
  batch, bag_size = ids.shape
  coef = reference.bag_coefficients(ids, weights, num_embeddings, combiner)
  table_grad = _triton_segment_sum(
      g, jnp.arange(batch * bag_size, dtype=jnp.int32) // max(bag_size, 1), ids.reshape(-1),
      num_embeddings, coef.reshape(-1), table.dtype, interpret,
  )
  weights_grad = None
  if weights is not None:
    # The weight gradient needs <g[b], row[b, l]> per slot; XLA's fused
    # gather-reduce of the reference is the simple, correct way to get it.
    _, vjp = jax.vjp(lambda w: reference.bag_reference(table, ids, w, combiner=combiner), weights)
    (weights_grad,) = vjp(g)
  return sum_to_varying_of(table_grad, table), None, weights_grad


_bag_ad.defvjp(_bag_fwd, _bag_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _mosaic_bag_ad(table, ids, weights, combiner, mode):
  coef = reference.bag_coefficients(ids, weights, table.shape[0], combiner)
  fn = lambda t, i, c: bag_mosaic(t, i, c, interpret=mode is True)
  return _mosaic(fn, mode, "embedlib_bag_mosaic")(table, ids, coef)


def _mosaic_bag_fwd(table, ids, weights, combiner, mode):
  return _mosaic_bag_ad(table, ids, weights, combiner, mode), (table, ids, weights)


def _mosaic_bag_bwd(combiner, interpret, res, g):
  table, ids, weights = res
  batch, bag_size = ids.shape
  coef = reference.bag_coefficients(ids, weights, table.shape[0], combiner)
  table_grad = _mosaic_segment_sum(
      g, jnp.arange(batch * bag_size, dtype=jnp.int32) // max(bag_size, 1), ids.reshape(-1),
      table.shape[0], coef.reshape(-1), table.dtype, interpret,
  )
  weights_grad = None
  if weights is not None:
    _, vjp = jax.vjp(lambda w: reference.bag_reference(table, ids, w, combiner=combiner), weights)
    (weights_grad,) = vjp(g)
  return sum_to_varying_of(table_grad, table), None, weights_grad


_mosaic_bag_ad.defvjp(_mosaic_bag_fwd, _mosaic_bag_bwd)

_XLA = {
    "gather": reference.gather_reference,
    "bag": lambda t, i, w, combiner: bag_xla(t, i, w, combiner=combiner),
}


def _bag_impl(impl: str, combiner: str, auto: bool = False):
  """``f(table, ids, weights)`` of implementation ``impl`` (no C++ bag: XLA's)."""
  if impl in (XLA, CPU):
    return lambda t, i, w: bag_xla(t, i, w, combiner=combiner)
  if impl in (TRITON, TRITON_INTERPRET):
    fn = lambda t, i, w, combiner: _bag_ad(t, i, w, combiner, impl == TRITON_INTERPRET)
  else:
    mode = {MOSAIC: False, MOSAIC_ORDERED: MOSAIC_ORDERED, MOSAIC_INTERPRET: True}[impl]
    fn = _shape_checked(
        lambda t, i, w, combiner: _mosaic_bag_ad(t, i, w, combiner, mode), "bag")
  if auto:
    fn = _auto_checked(fn, "bag")
  return lambda t, i, w: fn(t, i, w, combiner)


def bag(
    table: jax.Array,
    ids: jax.Array,
    weights: jax.Array | None = None,
    *,
    combiner: str = "sum",
    kernel: str = "auto",
    interpret: bool | None = None,
):
  """Pooled multi-hot lookup of padded bags (TensorFlow / keras-rs combiner semantics).

  ``sum = Σ w r``, ``mean = Σ w r / Σ w``, ``sqrtn = Σ w r / sqrt(Σ w²)`` over
  the valid ids of each bag (``w = 1`` without weights); an empty bag, or a
  zero denominator, gives zeros.

  Args:
    table: ``[num_embeddings, features]``, any float dtype.
    ids: int ``[batch, bag]`` padded with -1; any id outside
      ``[0, num_embeddings)`` is padding. Build it from ragged ids with
      `ragged_to_padded`.
    weights: optional float ``[batch, bag]``.
    combiner: ``"sum"``, ``"mean"`` or ``"sqrtn"``.
    kernel: one of ``options.KERNELS`` (see `plan`).
    interpret: Pallas interpreter on (True), off (False) or on CPU only (None).

  Returns:
    ``[batch, features]`` in ``table.dtype``. Differentiable w.r.t. ``table``
    and ``weights``.

  >>> import jax.numpy as jnp
  >>> table = jnp.arange(6.0).reshape(3, 2)
  >>> ids = jnp.array([[0, 2, -1], [-1, -1, -1]])
  >>> bag(table, ids, combiner="mean", kernel="pallas").tolist()
  [[2.0, 3.0], [0.0, 0.0]]
  """
  _check_operands("bag", table, ids)
  reference.check_combiner(combiner)
  check_bag_shapes(ids, weights)
  chosen = plan(kernel, interpret)
  branches = {}
  for platform, impl in chosen.items():
    auto = kernel == "auto" and platform == "gpu"
    same = next((b for p, b in branches.items() if chosen[p] == impl and not auto), None)
    branches[platform] = same or _bag_impl(impl, combiner, auto)
  return platforms.by_platform(table, ids, weights, **branches)
