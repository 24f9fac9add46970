"""Version switches between the supported jax / flax releases, in one place.

Supported: Python 3.11 with jax 0.10.x / flax 0.12.8, and Python 3.12 with
jax >= 0.11 / flax >= 0.12.9. Everything that differs between them is
resolved here so the rest of the library imports one name.
"""

from __future__ import annotations

import jax
from jax import sharding as _sharding

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

shard_map = jax.shard_map
AbstractMesh = _sharding.AbstractMesh
Mesh = _sharding.Mesh
AxisType = _sharding.AxisType
reshard = _sharding.reshard
use_abstract_mesh = _sharding.use_abstract_mesh


def current_mesh():
  """The mesh set with ``jax.set_mesh`` (concrete if any, else abstract), or None."""
  try:
    mesh = _sharding.get_mesh()
  except ValueError:  # inside a trace only the abstract mesh can be read
    mesh = None
  if mesh is not None and not mesh.empty:
    return mesh
  abstract = _sharding.get_abstract_mesh()
  if abstract is not None and not abstract.empty:
    return abstract
  return None


def is_explicit(mesh, axes) -> bool:
  """Whether any of ``axes`` is an Explicit axis of ``mesh``."""
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  return any(types[a] == AxisType.Explicit for a in axes)


def place(x, mesh, spec):
  """Lays ``x`` out as ``spec`` on ``mesh`` where shard_map needs it.

  On Explicit axes shard_map rejects arguments whose sharding differs from
  its ``in_specs``, so they are resharded first; on Auto axes shard_map
  reshards by itself and ``x`` is returned unchanged.
  """
  if not is_explicit(mesh, mesh.axis_names):
    return x
  return reshard(x, _sharding.NamedSharding(mesh, spec))


def has_devices(mesh) -> bool:
  """Whether ``mesh`` is a concrete ``Mesh``, not an ``AbstractMesh``.

  Not ``hasattr(mesh, "devices")``: ``AbstractMesh.devices`` raises
  ``ValueError``, which ``hasattr`` lets through.
  """
  return isinstance(mesh, _sharding.Mesh)


def any_tracer(*values) -> bool:
  """Whether any leaf of ``values`` is a tracer (inside jit, grad, vmap...)."""
  return any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(values))


def place_always(x, sharding):
  """Moves ``x`` to ``sharding`` on any mesh (eager or traced)."""
  mesh = sharding.mesh
  if is_explicit(mesh, mesh.axis_names):
    return reshard(x, sharding)
  if isinstance(x, jax.core.Tracer) or not has_devices(mesh):
    return jax.lax.with_sharding_constraint(x, sharding)
  # A jitted identity, not device_put: it also moves arrays that span
  # several processes.
  return jax.jit(lambda y: y, out_shardings=sharding)(x)


def leading_spec(x, mesh):
  """The mesh axes ``x``'s leading dimension is split over, on Explicit axes.

  Returns None when ``mesh`` has no Explicit axes (the compiler picks
  layouts there), else the spec entry, with ``()`` for an unsplit dimension.
  """
  if not is_explicit(mesh, mesh.axis_names):
    return None
  spec = jax.typeof(x).sharding.spec
  entry = spec[0] if len(spec) else None
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def varying_axes(x) -> frozenset:
  """Mesh axes a value inside ``shard_map`` is typed as varying over.

  Empty outside ``shard_map`` and when its type check is off.
  """
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))
