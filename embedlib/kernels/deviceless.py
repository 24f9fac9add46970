"""Compiling for H100 / H200 GPUs on a machine without one ("deviceless" compiles).

`lowering` stops at StableHLO text; this module runs the rest of the GPU
toolchain: XLA's GPU passes and scheduler, the Mosaic GPU kernels' own
compilation, and ptxas for ``sm_90a``. It needs the CUDA PJRT plugin
installed (``pip install -e '.[gpu-compile]'``, Python >= 3.12) and
``JAX_PLATFORMS=cpu``: without a GPU the plugin's start-up check fails on
``cuInit`` and the plugin never registers as a backend, but its compiler
still answers `gpu_mesh`'s topology request.

The devices are described by XLA's own target specs (``gpu_targets/``:
``xla/backends/gpu/target_config/specs``' H100 SXM and H200 files, as
embedded in jax-cuda12-plugin 0.12.0.1), so memory size and bandwidth are
the real ones. Nothing is
autotuned: a compile proves the program builds and shows its buffers, not
how fast it runs.

Typical use::

    mesh = deviceless.gpu_mesh((8,), ("batch",), target="H200")
    x = jax.ShapeDtypeStruct((1024, 128), jnp.float32,
                             sharding=NamedSharding(mesh, P("batch")))
    compiled = deviceless.gpu_compile(lambda x: x * 2, x, mesh=mesh)
    compiled.memory_analysis().temp_size_in_bytes
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
from collections.abc import Callable, Mapping, Sequence

import jax
from jax import sharding as _sharding

#: The GPUs there is a target spec for, and their spec files.
TARGETS = {"H100": "h100_sxm.txtpb", "H200": "h200.txtpb"}

#: Per-compile XLA options that deviceless compiles need, and real runs must not get.
# XLA sizes the scratch of its CUB radix sort by asking the device, and there
# is none ("cudaErrorInvalidDevice" at compile time); its own sort kernel
# needs no device. Passed to each deviceless ``.compile()``, never through
# XLA_FLAGS, so a real run in the same process still sorts with CUB.
DEVICELESS_COMPILER_OPTIONS: Mapping[str, object] = {"xla_gpu_enable_cub_radix_sort": False}

_SPECS = pathlib.Path(__file__).parent / "gpu_targets"


def unavailable_reason() -> str | None:
  """Why deviceless GPU compiles can't run here, or None when they can.

  >>> reason = unavailable_reason()
  >>> reason is None or "gpu-compile" in reason
  True
  """
  if importlib.util.find_spec("jax_plugins") is None or (
      importlib.util.find_spec("jax_plugins.xla_cuda12") is None):
    return ("the CUDA PJRT plugin is not installed; on Python >= 3.12 run "
            "pip install -e '.[gpu-compile]' (jax-cuda12-plugin matching jax "
            f"{jax.__version__}, nvcc and nvJitLink).")
  try:
    _topology("H100", 1)
  except Exception as e:  # the plugin's error says what is missing
    return (f"the CUDA plugin can't describe a GPU topology ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}); run with JAX_PLATFORMS=cpu and the "
            "plugin of the installed jax's version (pip install -e '.[gpu-compile]').")
  return None


def target_spec(target: str) -> str:
  """The ``GpuTargetConfigProto`` text of ``target`` (a key of `TARGETS`)."""
  if target not in TARGETS:
    raise ValueError(f"deviceless: no GPU target {target!r}; use one of {tuple(TARGETS)}.")
  return (_SPECS / TARGETS[target]).read_text()


@functools.cache
def _topology(target: str, num_devices: int):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  return topologies.get_topology_desc(
      platform="cuda", target_config=target_spec(target), topology=f"1x1x{num_devices}")


def device_memory_bytes(target: str) -> int:
  """HBM of one ``target`` GPU, as its spec states (``device_memory_size``)."""
  for line in target_spec(target).splitlines():
    if line.strip().startswith("device_memory_size:"):
      return int(line.split(":")[1])
  raise ValueError(f"deviceless: the {target} spec states no device_memory_size.")


def gpu_mesh(axis_sizes: Sequence[int], axis_names: Sequence[str], *, target: str = "H100",
             axis_types=None) -> jax.sharding.Mesh:
  """A mesh of compile-only ``target`` GPUs on one host (NVLink-connected).

  Args:
    axis_sizes: mesh shape, e.g. ``(2, 4)``.
    axis_names: one name per axis (the constants of `embedlib.axes`).
    target: a key of `TARGETS`.
    axis_types: ``jax.sharding.AxisType`` per axis; default all Explicit.

  Returns:
    A ``jax.sharding.Mesh`` whose devices can compile but never run.
  """
  axis_sizes, axis_names = tuple(int(s) for s in axis_sizes), tuple(axis_names)
  if len(axis_sizes) != len(axis_names):
    raise ValueError(f"gpu_mesh: {len(axis_sizes)} axis sizes {axis_sizes} but "
                     f"{len(axis_names)} names {axis_names}; give one name per axis.")
  count = 1
  for size in axis_sizes:
    count *= size
  devices = _topology(target, count).devices
  if axis_types is None:
    axis_types = (_sharding.AxisType.Explicit,) * len(axis_sizes)
  import numpy as np  # pylint: disable=g-import-not-at-top

  return _sharding.Mesh(np.array(devices).reshape(axis_sizes), axis_names,
                        axis_types=tuple(axis_types))


def lower(fn: Callable, *abstract_args, mesh: jax.sharding.Mesh, **jit_kwargs):
  """``jax.jit(fn, **jit_kwargs)`` traced on ``mesh``'s abstract mesh and lowered.

  Pallas's GPU lowering reads the target from the abstract mesh, so tracing
  happens under ``use_abstract_mesh``.
  """
  with _sharding.use_abstract_mesh(mesh.abstract_mesh):
    # Named, because a program on one compile-only device is otherwise lowered
    # for the platform alias "gpu", which only a registered GPU backend resolves.
    return jax.jit(fn, **jit_kwargs).trace(*abstract_args).lower(lowering_platforms=("cuda",))


def gpu_compile(fn: Callable, *abstract_args, mesh: jax.sharding.Mesh,
            compiler_options: Mapping[str, object] | None = None, **jit_kwargs):
  """``fn`` compiled for ``mesh``'s GPUs: ``jax.stages.Compiled``, never run.

  Args:
    fn: the function to compile.
    *abstract_args: ``jax.ShapeDtypeStruct`` leaves, sharded on ``mesh``.
    mesh: from `gpu_mesh`.
    compiler_options: extra XLA options for this compile (beside
      `DEVICELESS_COMPILER_OPTIONS`).
    **jit_kwargs: passed to ``jax.jit`` (``donate_argnums``, ...).

  Returns:
    The compiled program: ``memory_analysis()``, ``as_text()`` (the
    optimized, scheduled HLO).
  """
  options = {**DEVICELESS_COMPILER_OPTIONS, **(compiler_options or {})}
  return lower(fn, *abstract_args, mesh=mesh, **jit_kwargs).compile(compiler_options=options)
