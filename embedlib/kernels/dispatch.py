"""Public lookups: kernel choice (``xla`` / ``pallas`` / ``cpu`` / ``auto``) and autodiff.

``kernel="xla"`` runs the pure-jnp gather reference (differentiated by jax's
own rules) and `bag_xla` (the bag reference's sums, slot by slot, with a
hand-written backward). ``kernel="cpu"`` runs the C++ gather of
`gather_cpu` (the reference's gradient) and `bag_xla` for bags.
``kernel="pallas"`` runs the Triton kernels; a
``pallas_call`` has no autodiff, so each lookup is a ``jax.custom_vjp`` whose
backward is the deterministic Pallas segment sum of `backward`. The target
platform is read at trace time from the abstract mesh in context when it
names a device (so lowering for CUDA under an abstract GPU mesh picks the
compiled kernels on a CPU machine), else from ``jax.default_backend()``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from embedlib import options
from embedlib.kernels import cpu_library
from embedlib.kernels import reference
from embedlib.kernels.backward import segment_sum_rows
from embedlib.kernels.bag_pallas import bag_pallas, check_bag_shapes
from embedlib.kernels.bag_xla import bag_xla
from embedlib.kernels.gather_cpu import gather_cpu
from embedlib.kernels.gather_pallas import gather_pallas
from embedlib.sharding import sum_to_varying_of

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def target_platform() -> str:
  """Platform being traced for: the abstract mesh's device if set, else the default backend.

  >>> target_platform()
  'cpu'
  """
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh is None or mesh.empty else getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "platform", None):
    return device.platform
  return jax.default_backend()


def resolve_kernel(kernel: str) -> str:
  """Maps a ``kernel`` option to ``"xla"``, ``"pallas"`` or ``"cpu"``.

  ``"auto"`` is ``"pallas"`` when tracing for a GPU, ``"cpu"`` (the C++
  gather of `gather_cpu`) when tracing for the CPU and its library is
  available (`cpu_library.available`), and ``"xla"`` otherwise (XLA's CPU
  gather beats an interpreted Pallas kernel by orders of magnitude).

  Args:
    kernel: one of ``options.KERNELS``.

  Returns:
    ``"xla"``, ``"pallas"`` or ``"cpu"``.

  Raises:
    ValueError: for any other name, or ``"cpu"`` when tracing for another
      platform.

  >>> resolve_kernel("pallas"), resolve_kernel("xla")
  ('pallas', 'xla')
  """
  if kernel not in options.KERNELS:
    raise ValueError(
        f"kernel={kernel!r} is not a lookup kernel; use one of {options.KERNELS} "
        "('auto' picks 'pallas' on GPU, 'cpu' on CPU where its C++ library "
        "builds, and 'xla' elsewhere)."
    )
  platform = target_platform()
  if kernel == "auto":
    if platform in _GPU_PLATFORMS:
      return "pallas"
    return "cpu" if platform == "cpu" and cpu_library.available() else "xla"
  if kernel == "cpu" and platform != "cpu":
    raise ValueError(
        f"kernel='cpu' is the CPU's C++ gather, but this lookup is traced for "
        f"{platform!r}; use kernel='auto' (or 'pallas' on GPU, 'xla' anywhere)."
    )
  return kernel


def resolve_interpret(interpret: bool | None) -> bool:
  """``interpret=None`` means the Pallas interpreter when tracing for the CPU.

  >>> resolve_interpret(None), resolve_interpret(False)
  (True, False)
  """
  if interpret is None:
    return target_platform() == "cpu"
  return bool(interpret)


def shard_map_check_vma(kernel: str = "auto", interpret: bool | None = None) -> bool:
  """The ``check_vma`` to give a ``jax.shard_map`` whose body calls these lookups.

  False exactly when the lookup will run the Pallas *interpreter*: jax's
  interpreter evaluates the kernel body with ordinary primitives, and those
  reject the kernel's own index arithmetic (not varying) meeting a sharded
  table (varying) -- the error text itself suggests ``check_vma=False``
  (seen on jax 0.10.2 and 0.12). Compiled kernels, and CUDA lowering, work
  with ``check_vma=True``, and the kernels declare their outputs' varying
  axes for it.

  >>> shard_map_check_vma("xla"), shard_map_check_vma("pallas", interpret=True)
  (True, False)
  """
  return not (resolve_kernel(kernel) == "pallas" and resolve_interpret(interpret))


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_ad(table, ids, interpret):
  return gather_pallas(table, ids, interpret=interpret)


def _gather_fwd(table, ids, interpret):
  return gather_pallas(table, ids, interpret=interpret), (table, ids)


def _gather_bwd(interpret, res, g):
  table, ids = res
  features = table.shape[1]
  flat = ids.reshape(-1)
  grad = segment_sum_rows(
      g.reshape(-1, features),
      jnp.arange(flat.shape[0], dtype=jnp.int32),
      flat,
      table.shape[0],
      dtype=table.dtype,
      interpret=interpret,
  )
  return sum_to_varying_of(grad, table), None


_gather_ad.defvjp(_gather_fwd, _gather_bwd)


def gather(table: jax.Array, ids: jax.Array, *, kernel: str = "auto", interpret: bool | None = None):
  """Row lookup ``table[ids]`` with zero rows (and no gradient) for invalid ids.

  Args:
    table: ``[num_embeddings, features]``, any float dtype (a local shard
      inside ``jax.shard_map``).
    ids: int array of any shape; ids outside ``[0, num_embeddings)`` read
      zeros.
    kernel: ``"auto"``, ``"xla"``, ``"pallas"`` or ``"cpu"`` (see `resolve_kernel`).
    interpret: Pallas interpreter on/off; None means on when tracing for CPU.

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
  resolved = resolve_kernel(kernel)
  if resolved == "xla":
    return reference.gather_reference(table, ids)
  if resolved == "cpu":
    return gather_cpu(table, ids)
  return _gather_ad(table, ids, resolve_interpret(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _bag_ad(table, ids, weights, combiner, interpret):
  return bag_pallas(table, ids, weights, combiner=combiner, interpret=interpret)


def _bag_fwd(table, ids, weights, combiner, interpret):
  out = bag_pallas(table, ids, weights, combiner=combiner, interpret=interpret)
  return out, (table, ids, weights)


def _bag_bwd(combiner, interpret, res, g):
  table, ids, weights = res
  num_embeddings = table.shape[0]
  batch, bag_size = ids.shape
  coef = reference.bag_coefficients(ids, weights, num_embeddings, combiner)
  table_grad = segment_sum_rows(
      g,
      jnp.arange(batch * bag_size, dtype=jnp.int32) // max(bag_size, 1),
      ids.reshape(-1),
      num_embeddings,
      coef=coef.reshape(-1),
      dtype=table.dtype,
      interpret=interpret,
  )
  weights_grad = None
  if weights is not None:
    # The weight gradient needs <g[b], row[b, l]> per slot; XLA's fused
    # gather-reduce of the reference is the simple, correct way to get it.
    _, vjp = jax.vjp(lambda w: reference.bag_reference(table, ids, w, combiner=combiner), weights)
    (weights_grad,) = vjp(g)
  return sum_to_varying_of(table_grad, table), None, weights_grad


_bag_ad.defvjp(_bag_fwd, _bag_bwd)


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
    kernel: ``"auto"``, ``"xla"``, ``"pallas"`` or ``"cpu"`` (see `resolve_kernel`).
    interpret: Pallas interpreter on/off; None means on when tracing for CPU.

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
  # No C++ bag kernel: the XLA bag. Bags of width 0 too (every bag empty,
  # zeros): a Pallas call on zero-size blocks doesn't compile inside shard_map.
  if resolve_kernel(kernel) in ("xla", "cpu") or ids.shape[-1] == 0:
    return bag_xla(table, ids, weights, combiner=combiner)
  return _bag_ad(table, ids, weights, combiner, resolve_interpret(interpret))
