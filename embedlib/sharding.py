"""Sharding helpers shared by the kernels, strategies and modules.

Three kinds, all about where an array's pieces live on the mesh:

- placement: the mesh in context, Explicit vs Auto axes, and moving an
  array to a layout (``place``, ``place_always``, ``leading_spec``);
- token padding: the token (batch) dimension padded to a multiple of the
  data shards before ``shard_map`` and stripped after (``pad_tokens``,
  ``restore_tokens``);
- ``shard_map`` types: inside ``shard_map`` with its type check on, each
  value is typed by the mesh axes it varies over, and kernels must keep
  those types right (``varying_axes``, ``match_varying``,
  ``sum_to_varying_of``, ``out_struct``).

Imports nothing of embedlib but ``_compat``, so every layer may use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import sharding as _sharding
from jax.sharding import PartitionSpec as P

from embedlib import _compat

# -- placement --------------------------------------------------------------


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


def no_context_mesh():
  """A context without the mesh set by ``jax.set_mesh``, for calling ``shard_map``.

  ``shard_map`` is given its mesh explicitly and needs none in context. With
  one in context, ``checkify`` fails to trace a ``shard_map`` that follows a
  ``checkify.check`` (its error values are rebuilt outside the manual mesh:
  seen on jax 0.10.2 and 0.12), which would break ``invalid_ids="error"``,
  the dedup capacity check under ``jit`` and a DLRM's interaction after them.
  """
  return _compat.use_abstract_mesh(_compat.AbstractMesh((), ()))


def mesh_or_current(mesh):
  """The mesh a table is built on: ``mesh`` if given, else ``current_mesh()`` (or None).

  Every table kind reads its mesh here, so that a table built inside
  ``jax.set_mesh`` is laid out over that mesh whatever its kind.
  """
  return current_mesh() if mesh is None else mesh


def is_explicit(mesh, axes) -> bool:
  """Whether any of ``axes`` is an Explicit axis of ``mesh``."""
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  return any(types[a] == _compat.AxisType.Explicit for a in axes)


def has_devices(mesh) -> bool:
  """Whether ``mesh`` is a concrete ``Mesh``, not an ``AbstractMesh``.

  Not ``hasattr(mesh, "devices")``: ``AbstractMesh.devices`` raises
  ``ValueError``, which ``hasattr`` lets through.
  """
  return isinstance(mesh, _sharding.Mesh)


def any_tracer(*values) -> bool:
  """Whether any leaf of ``values`` is a tracer (inside jit, grad, vmap...)."""
  return any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(values))


def place(x, mesh, spec):
  """Lays ``x`` out as ``spec`` on ``mesh`` where shard_map needs it.

  On Explicit axes shard_map rejects arguments whose sharding differs from
  its ``in_specs``, so they are resharded first; on Auto axes shard_map
  reshards by itself and ``x`` is returned unchanged.
  """
  if not is_explicit(mesh, mesh.axis_names):
    return x
  return _compat.reshard(x, _sharding.NamedSharding(mesh, spec))


def place_always(x, sharding):
  """Moves ``x`` to ``sharding`` on any mesh (eager or traced)."""
  mesh = sharding.mesh
  if is_explicit(mesh, mesh.axis_names):
    return _compat.reshard(x, sharding)
  if isinstance(x, jax.core.Tracer) or not has_devices(mesh):
    return jax.lax.with_sharding_constraint(x, sharding)
  # A jitted identity, not device_put: it also moves arrays that span
  # several processes.
  return jax.jit(lambda y: y, out_shardings=sharding)(x)


def unsplit(x):
  """``x`` whole on every device when it is split over Explicit mesh axes.

  For arrays read across their whole length (a ragged batch's ``cumsum``
  of lengths, and the gather of values at those offsets), which JAX
  refuses on an array split over Explicit axes. Anything else (numpy, an
  unsplit array, Auto axes) is returned unchanged.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or all(s is None for s in sharding.spec):
    return x
  if not is_explicit(mesh, mesh.axis_names):
    return x
  return _compat.reshard(x, _sharding.NamedSharding(mesh, P()))


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


# -- token padding ----------------------------------------------------------


def pad_tokens(x, multiple: int, fill):
  """Pads the leading (token) dimension of ``x`` up to a multiple of ``multiple``.

  An empty batch gets one padding token per shard: XLA rejects collectives
  (``all_gather``) over a zero-size dimension, and ``restore_tokens``
  strips the padding again.

  >>> pad_tokens(jnp.array([1, 2, 3]), 2, -1).tolist()
  [1, 2, 3, -1]
  >>> pad_tokens(jnp.zeros((0, 2), jnp.int32), 2, -1).tolist()
  [[-1, -1], [-1, -1]]
  """
  pad = -x.shape[0] % multiple if x.shape[0] else multiple
  if not pad:
    return x
  return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)


def restore_tokens(x, tokens: int, mesh, spec):
  """Strips token padding and gives the result the ids' own batch split.

  On Explicit axes the batch split is part of the array's type, so a lookup
  returns its rows split the way its ids were (a drop-in for ``jnp.take``):
  ids already split over the data axes cost nothing here.

  Args:
    x: ``[padded_tokens, ...]``.
    tokens: the unpadded count.
    mesh: the mesh, or None.
    spec: ``leading_spec`` of the ids, taken before they were padded.
  """
  if mesh is None:
    return x[:tokens]
  if x.shape[0] != tokens:
    # An uneven batch can't have been split: gather, as slicing a split
    # dimension is not allowed on Explicit axes.
    x = place(x, mesh, P())[:tokens]
  if spec is not None and spec != leading_spec(x, mesh):
    x = place(x, mesh, P(spec or None))
  return x


# -- shard_map types --------------------------------------------------------


def _manual_axis_type(x):
  return getattr(jax.typeof(x), "manual_axis_type", None)


def varying_axes(x) -> frozenset:
  """Mesh axes a value inside ``shard_map`` is typed as varying over.

  Empty outside ``shard_map`` and when its type check is off.
  """
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def match_varying(*operands) -> list:
  """Operands cast to vary over the union of their manual mesh axes.

  Inside ``jax.shard_map`` (``check_vma=True``) a ``pallas_call`` in
  interpret mode evaluates its body with ordinary primitives, which reject
  mixing, say, a vocab-sharded table with replicated ids. ``pcast`` only
  changes the type (no data moves); outside ``shard_map`` this is the identity.

  >>> len(match_varying(jnp.zeros(2), jnp.ones(3)))
  2
  """
  mats = [_manual_axis_type(x) for x in operands]
  if any(m is None for m in mats):  # a jax without manual axis types
    return list(operands)
  union = frozenset().union(*(m.varying for m in mats))
  return [
      jax.lax.pcast(x, tuple(sorted(union - m.varying)), to="varying") if union - m.varying else x
      for x, m in zip(operands, mats)
  ]


def sum_to_varying_of(x: jax.Array, like: jax.Array) -> jax.Array:
  """``psum`` of ``x`` over the manual axes it varies over and ``like`` does not.

  A custom_vjp backward must return a cotangent typed like its primal. A table
  replicated over, say, the data axis but read with data-sharded ids was
  implicitly broadcast in the forward; the transpose of that broadcast is this
  sum (the data-parallel gradient reduction).

  >>> sum_to_varying_of(jnp.ones(2), jnp.zeros(3)).tolist()
  [1.0, 1.0]
  """
  mx, ml = _manual_axis_type(x), _manual_axis_type(like)
  if mx is None or ml is None:
    return x
  extra = tuple(sorted(mx.varying - ml.varying))
  return jax.lax.psum(x, extra) if extra else x


def out_struct(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
  """Output type of a ``pallas_call``, varying over every manual axis its operands vary over.

  Inside ``jax.shard_map`` (``check_vma=True``) a ``pallas_call`` cannot infer
  how its output varies across mesh axes and rejects a plain
  ``ShapeDtypeStruct``; outside it the set is empty and this is a plain one.

  >>> out_struct((2, 3), jnp.float32, jnp.zeros(4)).shape
  (2, 3)
  """
  mats = [_manual_axis_type(x) for x in operands]
  mats = [m for m in mats if m is not None]
  if not mats:
    return jax.ShapeDtypeStruct(shape, dtype)
  varying = frozenset().union(*(m.varying for m in mats))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))
