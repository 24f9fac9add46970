"""Public lookups: which kernel runs on which platform, and autodiff.

A ``kernel=`` option names a family; `plan` turns it into one
implementation per platform (CPU, CUDA, any other), and `gather` / `bag`
stage all of them with ``lax.platform_dependent`` (`platforms.by_platform`),
so the platform a program is *lowered* for picks its kernel, whatever
machine traced it. Implementations:

- ``"xla"``: the jnp gather of `xla` (differentiated by jax) and
  `bag_xla` (`xla.bag_segment_sum`'s sums slot by slot, a hand-written
  backward);
- ``"cpu"``: the C++ gather of `gather_cpu` (`xla.gather`'s gradient),
  and `bag_cpu` for bags (the C++ gather for one id a row, the C++ pooled
  bag for wider float32 bags, else `bag_xla`);
- ``"mosaic"``: the Mosaic GPU kernels (`gather_mosaic`, `bag_mosaic`,
  `backward_mosaic`), compiled (CUDA only, through `platforms.on_gpu`) or
  run by Mosaic GPU's interpreter (``"mosaic-interpret"``, jax >= 0.11);
- ``"triton"``: the Triton Pallas kernels, compiled or run by the Pallas
  interpreter (``"triton-interpret"``, any platform).

A kernel has no autodiff, so each Pallas lookup is a ``jax.custom_vjp``
whose backward is a deterministic segment sum, no colliding scatter-add
(`pallas_ad`).
A table the Mosaic kernels do not take (rows not whole 16-byte units,
`mosaic.supports`) runs the XLA ops instead.

Options: ``"xla"`` everywhere; ``"cpu"`` is the C++ gather on CPU and XLA
elsewhere; ``"mosaic"`` and ``"triton"`` name a Pallas backend, compiled on
CUDA and interpreted on CPU (``interpret=True`` / ``False`` forces one of
them on every platform; jax 0.10 has no Mosaic interpreter, so its CPU runs
XLA there); ``"pallas"`` is the backend of this jax (`pallas_backend`:
Mosaic GPU from jax 0.11, where JAX deprecates Triton; Triton on 0.10);
``"auto"`` runs on CUDA what the newest GPU sweep measured fastest
(`gpu_choice`: a many-rows-in-flight Triton kernel, ``rows_ad``, for the
forward and for the backward separately, where it beat XLA's ops; XLA's ops
everywhere else, and everywhere while no sweep has measured one), the C++
gather on CPU where its library builds (`cpu_library.available`), and XLA
elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from embedlib import options
from embedlib import sharding as sharding_lib
from embedlib.kernels import bags
from embedlib.kernels import cpu_library
from embedlib.kernels import gpu_choice
from embedlib.kernels import mosaic
from embedlib.kernels import pallas_ad
from embedlib.kernels import platforms
from embedlib.kernels import rows_ad
from embedlib.kernels import xla
from embedlib.kernels.bag_pallas import check_bag_shapes
from embedlib.kernels.bag_xla import bag_xla
from embedlib.kernels.bag_cpu import bag_cpu
from embedlib.kernels.gather_cpu import gather_cpu

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
        "('auto' picks what was measured fastest on GPU, the C++ gather on CPU where "
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


def _empty(shape, table: jax.Array, *operands) -> jax.Array:
  """Zeros of ``shape`` in ``table.dtype``, the result of a lookup with no ids.

  One constant for every platform, without calling a kernel: a zero-size
  ``pallas_call`` does not compile, and the kernels type an empty result
  differently inside ``shard_map`` (the C++ gather's varies over the
  operands' mesh axes, jnp's ops on zero-size arrays fold to a constant
  that varies over none), which ``lax.platform_dependent`` rejects. Typed
  to vary as XLA's ops on nonempty operands would, so a ``shard_map`` body
  sees the same types whatever the batch.
  """
  return sharding_lib.match_varying(jnp.zeros(shape, table.dtype), table, *operands)[0]


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


#: Implementation -> (backend, mode) of `pallas_ad`.
_PALLAS = {
    TRITON: ("triton", pallas_ad.COMPILED),
    TRITON_INTERPRET: ("triton", pallas_ad.INTERPRET),
    MOSAIC: ("mosaic", pallas_ad.COMPILED),
    MOSAIC_ORDERED: ("mosaic", pallas_ad.BESIDE_INTERPRETER),
    MOSAIC_INTERPRET: ("mosaic", pallas_ad.INTERPRET),
}
_XLA = {
    "gather": xla.gather,
    "bag": lambda t, i, w, combiner: bag_xla(t, i, w, combiner=combiner),
}


def _auto_variants(kind: str, table, ids) -> tuple[str | None, str | None]:
  """The Triton rows variants ``auto`` runs on CUDA for (the forward, the backward), None for XLA."""
  features = table.shape[1]
  bag_size = ids.shape[1] if kind == "bag" else 0
  runnable = lambda v: v if v is not None and v.startswith(gpu_choice.RUNNABLE) else None
  return (runnable(gpu_choice.choose(kind, features, table.dtype, bag=bag_size)),
          runnable(gpu_choice.choose("backward", features, table.dtype)))


def _runs_xla(kind: str, impl: str, auto: bool, table, ids) -> bool:
  """Whether ``impl`` (``auto``'s CUDA branch if ``auto``) runs XLA's ops on these operands.

  The Mosaic kernels leave to XLA's ops the tables they do not take
  (`mosaic.supports`); ``auto`` runs `gpu_choice`'s variants, and
  `gpu_choice.FALLBACK` where it has none.
  """
  if impl == XLA:
    return True
  if impl not in _PALLAS:
    return False
  if auto:
    forward, backward = _auto_variants(kind, table, ids)
    if forward or backward:
      return False
    if gpu_choice.FALLBACK == XLA:
      return True
  return _PALLAS[impl][0] == MOSAIC and not mosaic.supports(table.shape, table.dtype)


def _lookup(kind: str, impl: str, auto: bool = False):
  """``f(table, ids, *rest)`` of implementation ``impl`` for ``kind`` ("gather" | "bag").

  ``auto`` runs `gpu_choice`'s variants (`rows_ad`) where it has them; where
  XLA's ops run instead, `_branches` has chosen `XLA` already (`_runs_xla`).
  """
  if impl == CPU:
    return gather_cpu if kind == "gather" else bag_cpu
  if impl == XLA:
    return _XLA[kind]
  backend, mode = _PALLAS[impl]
  pallas = (lambda t, i: pallas_ad.gather(t, i, backend, mode)) if kind == "gather" else (
      lambda t, i, w, combiner: pallas_ad.bag(t, i, w, combiner, backend, mode))
  if not auto:
    return pallas

  def run(table, ids, *rest, **kw):
    forward, backward = _auto_variants(kind, table, ids)
    if not (forward or backward):
      return pallas(table, ids, *rest, **kw)
    if kind == "gather":
      return rows_ad.gather(table, ids, forward, backward, False)
    return rows_ad.bag(table, ids, rest[0], kw["combiner"], forward, backward, False)

  return run


def _branches(kind: str, kernel: str, interpret: bool | None, table, ids) -> dict:
  """One function per platform for these operands, for `platforms.by_platform`.

  Platforms that run the same implementation get the same function, so the
  program stages it once; XLA's ops are one implementation wherever they
  run (a Mosaic kernel's unsupported table, ``auto`` without a measured
  variant).
  """
  keys = {}
  for platform, impl in plan(kernel, interpret).items():
    auto = kernel == "auto" and platform == "gpu"
    keys[platform] = (XLA, False) if _runs_xla(kind, impl, auto, table, ids) else (impl, auto)
  made = {key: _lookup(kind, *key) for key in set(keys.values())}
  return {p: made[key] for p, key in keys.items()}


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
  if ids.size == 0:
    return _empty(ids.shape + (table.shape[1],), table, ids)
  return platforms.by_platform(table, ids, **_branches("gather", kernel, interpret, table, ids))


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
  bags.check_combiner(combiner)
  check_bag_shapes(ids, weights)
  if ids.size == 0:  # no bags, or every bag empty: zeros for every combiner
    return _empty(ids.shape[:1] + (table.shape[1],), table, ids,
                  *(() if weights is None else (weights,)))
  fns = _branches("bag", kernel, interpret, table, ids)
  bound = {id(fn): functools.partial(fn, combiner=combiner) for fn in fns.values()}
  branches = {p: bound[id(fn)] for p, fn in fns.items()}
  return platforms.by_platform(table, ids, weights, **branches)
