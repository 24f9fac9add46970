"""Ahead-of-time CUDA lowering on a machine without a GPU, on every supported jax.

This is how tests prove that the GPU path builds: lowering a jitted function
for ``("cuda",)`` runs the Pallas GPU lowering (and the collectives'
lowering) without any GPU, and the StableHLO text names the kernels:
``__gpu$xla.gpu.triton`` for a Triton ``pallas_call``, ``mosaic_gpu_v2`` for
Mosaic GPU.

On jax 0.10 the ordinary CPU devices suffice; on jax >= 0.11 lowering checks
the target against the devices it traces with, so arguments must be abstract
(``ShapeDtypeStruct``) and tracing must happen under an `AbstractMesh` whose
``abstract_device`` is a GPU. That abstract route also works on jax 0.10.2
(checked), so these helpers use it on every version and callers never branch:
`gpu_abstract_mesh` builds the mesh (give it to ``shard_map`` and to
``NamedSharding`` of the arguments) and `cuda_lowering_text` traces under it.
The lookups choose their kernel per lowering platform (`dispatch`,
`platforms`), so a CUDA lowering holds the compiled Pallas kernels whatever
the trace context; the abstract GPU device is what lets jax >= 0.11 lower
them at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax import sharding as _sharding

#: Substrings that identify a Pallas GPU kernel in lowered StableHLO text.
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CALL = "mosaic_gpu_v2"

#: The abstract GPU used for lowering (an H200, what GPU machines carry).
GPU_DEVICE_KIND = "NVIDIA H200"
GPU_NUM_CORES = 132


def gpu_abstract_mesh(
    axis_sizes: Sequence[int] = (1,),
    axis_names: Sequence[str] = ("x",),
    *,
    axis_types=None,
):
  """An `AbstractMesh` whose devices are abstract H200 GPUs.

  Args:
    axis_sizes: mesh shape, e.g. ``(2, 4)`` for an 8-device mesh.
    axis_names: one name per axis (use the constants in `embedlib.axes`).
    axis_types: ``jax.sharding.AxisType`` per axis; default all Explicit.

  Returns:
    A ``jax.sharding.AbstractMesh`` usable as the mesh of ``jax.shard_map``,
    of ``NamedSharding`` and of `use_abstract_mesh`.

  >>> mesh = gpu_abstract_mesh((2, 4), ("data", "model"))
  >>> dict(mesh.shape)
  {'data': 2, 'model': 4}
  """
  axis_sizes = tuple(int(s) for s in axis_sizes)
  axis_names = tuple(axis_names)
  if len(axis_sizes) != len(axis_names):
    raise ValueError(
        f"gpu_abstract_mesh: {len(axis_sizes)} axis sizes {axis_sizes} but "
        f"{len(axis_names)} names {axis_names}; give one name per axis."
    )
  if axis_types is None:
    axis_types = (_sharding.AxisType.Explicit,) * len(axis_sizes)
  device = _sharding.AbstractDevice(
      device_kind=GPU_DEVICE_KIND, num_cores=GPU_NUM_CORES, platform="gpu"
  )
  return _sharding.AbstractMesh(
      axis_sizes, axis_names, axis_types=tuple(axis_types), abstract_device=device
  )


def lowering_context(mesh=None):
  """Context to trace in for CUDA lowering: ``use_abstract_mesh`` of an abstract GPU mesh.

  Args:
    mesh: an abstract GPU mesh from `gpu_abstract_mesh`, or None for one device.

  Returns:
    A context manager.
  """
  if mesh is None:
    mesh = gpu_abstract_mesh()
  if not isinstance(mesh, _sharding.AbstractMesh):
    raise TypeError(
        f"lowering_context: got a concrete {type(mesh).__name__}; lowering for "
        "CUDA on a CPU machine needs gpu_abstract_mesh(axis_sizes, axis_names) "
        "(jax >= 0.11 rejects CPU devices for a cuda target)."
    )
  return _sharding.use_abstract_mesh(mesh)


def cuda_lowering_text(fn: Callable, *abstract_args, mesh=None, **jit_kwargs) -> str:
  """StableHLO text of ``jax.jit(fn)`` lowered for CUDA, on a machine without a GPU.

  Args:
    fn: the function to lower.
    *abstract_args: ``jax.ShapeDtypeStruct`` (with a ``sharding`` on ``mesh``
      for sharded functions).
    mesh: the mesh from `gpu_abstract_mesh` for sharded functions; None for
      single-device kernels.
    **jit_kwargs: passed to ``jax.jit`` (e.g. ``static_argnums``).

  Returns:
    The lowered module as text; search it for `TRITON_CALL` and collectives.

  >>> import jax, jax.numpy as jnp
  >>> text = cuda_lowering_text(lambda x: x * 2, jax.ShapeDtypeStruct((4,), jnp.float32))
  >>> "stablehlo.multiply" in text
  True
  """
  with lowering_context(mesh):
    traced = jax.jit(fn, **jit_kwargs).trace(*abstract_args)
    return traced.lower(lowering_platforms=("cuda",)).as_text()
