"""Reading a mesh: axis sizes, default table and data axes, and their validation.

Pure Python: a mesh is read through its ``shape`` mapping only, so a concrete
``Mesh``, an ``AbstractMesh`` or a plain ``{axis: size}`` dict all work, and
nothing here allocates an array.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from embedlib import axes as axes_lib


def mesh_shape(mesh, *, name: str = "ShardedEmbed") -> dict[str, int]:
  """Axis sizes of ``mesh`` in mesh order; ``{}`` for no mesh (one device).

  >>> mesh_shape({"data": 2, "model": 4})
  {'data': 2, 'model': 4}
  >>> mesh_shape(None)
  {}
  """
  if mesh is None:
    return {}
  shape = mesh if isinstance(mesh, Mapping) else getattr(mesh, "shape", None)
  if not isinstance(shape, Mapping):
    raise TypeError(
        f"{name}: mesh must be a jax.sharding.Mesh, an AbstractMesh or a dict of axis "
        f"sizes, got {type(mesh).__name__}; build one with jax.make_mesh."
    )
  return {str(name): int(size) for name, size in shape.items()}


def axes_size(shape: Mapping[str, int], axes: Sequence[str]) -> int:
  """Number of devices spanned by ``axes`` (1 for no axes).

  >>> axes_size({"data": 2, "model": 4}, ("model",))
  4
  """
  return math.prod(shape[a] for a in axes)


def as_axes(value, role: str, name: str) -> tuple[str, ...] | None:
  if value is None:
    return None
  if isinstance(value, str):
    return (value,)
  try:
    out = tuple(value)
  except TypeError:
    raise TypeError(
        f"{name}: {role} must be a mesh axis name or a tuple of them, got "
        f"{value!r}; e.g. {role}=('model',)."
    ) from None
  for a in out:
    if not isinstance(a, str):
      raise TypeError(
          f"{name}: {role} must hold mesh axis names (str), got {a!r} in "
          f"{value!r}."
      )
  return out


def check_axes(axes, role: str, shape: Mapping[str, int], name: str) -> None:
  for a in axes:
    if a not in shape:
      raise ValueError(
          f"{name}: {role} names axis {a!r}, which is not an axis of the mesh "
          f"(its axes are {tuple(shape)}); pass {role} as a subset of those."
      )
  dupes = sorted({a for a in axes if axes.count(a) > 1})
  if dupes:
    raise ValueError(
        f"{name}: {role}={tuple(axes)} lists axis {dupes[0]!r} more than once; "
        f"name each mesh axis at most once."
    )


def resolve_axes(
    shape: Mapping[str, int],
    table_axes=None,
    data_axes=None,
    *,
    name: str = "ShardedEmbed",
) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Fills in and validates ``(table_axes, data_axes)`` for a mesh.

  Defaults: data axes are the mesh axes with a conventional data-parallel
  name (``axes.DATA_AXIS_NAMES``: data, batch, replica, ...). The table is
  split over the other axes; when every axis is a data axis (recommender
  training) the table spans all devices and each device holds other tokens.

  >>> resolve_axes({"data": 2, "model": 4})
  (('model',), ('data',))
  >>> resolve_axes({"batch": 8})
  (('batch',), ('batch',))
  >>> resolve_axes({"data": 2, "model": 4}, table_axes="model", data_axes=())
  (('model',), ())
  """
  table = as_axes(table_axes, "table_axes", name)
  data = as_axes(data_axes, "data_axes", name)
  if data is None:
    data = axes_lib.named_data_axes(shape)
  if table is None:
    table = tuple(a for a in shape if a not in data) or tuple(
        a for a in shape if a in data
    )
  check_axes(table, "table_axes", shape, name)
  check_axes(data, "data_axes", shape, name)
  return table, data


def even_split(
    shape: Sequence[int],
    mesh_shape_: Mapping[str, int],
    *,
    also_divides: Sequence[int] | None = None,
    prefer: Sequence = (),
) -> tuple:
  """The per-dimension mesh axes that split an array over the most devices, evenly.

  A ``jax.Array`` can't be split unevenly, so a table whose sizes don't
  divide its group (an unpadded table) is laid out over the mesh axes whose
  sizes do divide them. Each axis goes to one dimension or none; among the
  splits over the most devices, the one sharing most axes with ``prefer``
  (the layout the array comes from) wins, so it moves the least.

  Args:
    shape: the array's shape.
    mesh_shape_: ``{axis: size}`` of the mesh.
    also_divides: a second shape each dimension's split must divide (the
      padded table, which is resharded before its padding is cut off).
    prefer: per-dimension axes (None, a name or a tuple of names) to keep
      where possible.

  Returns:
    One entry per dimension: None or a tuple of axis names, in mesh order.

  >>> even_split((99, 64), {"data": 2, "model": 4}, prefer=(("model",), None))
  (None, ('data', 'model'))
  >>> even_split((7, 3), {"model": 4})
  (None, None)
  """
  ndim = len(shape)
  others = tuple(also_divides) if also_divides is not None else tuple(shape)
  kept = [_entry_axes(e) for e in tuple(prefer) + (None,) * (ndim - len(tuple(prefer)))]
  axes = [a for a, n in mesh_shape_.items() if n > 1]
  best, best_key = (None,) * ndim, (1, 0)
  for choice in itertools.product(range(ndim + 1), repeat=len(axes)):
    split = [tuple(a for a, d in zip(axes, choice) if d == i + 1) for i in range(ndim)]
    sizes = [axes_size(mesh_shape_, s) for s in split]
    if any(n % k or m % k for n, m, k in zip(shape, others, sizes)):
      continue
    key = (math.prod(sizes), sum(len(set(s) & set(k)) for s, k in zip(split, kept)))
    if key > best_key:
      best, best_key = tuple(s or None for s in split), key
  return best


def _entry_axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def devices_per_node(mesh, table_axes: Sequence[str]) -> int | None:
  """Devices per node of ``mesh``'s table group, read from its devices; None when unknown.

  A node is a run of consecutive ranks of the group (row-major over
  ``table_axes``) whose devices share one ``process_index`` (or, for TPU
  slices, ``slice_index``). None when the mesh has no devices (an
  ``AbstractMesh``, a dict), when every device of a group is in one node
  (the flat route), or when the runs are not all one length (no two-level
  route fits them: give ``devices_per_node`` explicitly).

  >>> devices_per_node({"batch": 8}, ("batch",)) is None
  True
  """
  try:
    devices = mesh.devices
  except (AttributeError, ValueError):  # a dict; an AbstractMesh raises ValueError
    return None
  if not table_axes or not hasattr(devices, "transpose"):
    return None
  names = list(mesh.axis_names)
  order = [names.index(a) for a in names if a not in table_axes] + [
      names.index(a) for a in table_axes]
  group = math.prod(mesh.shape[a] for a in table_axes)
  groups = devices.transpose(order).reshape(-1, group)
  for key in ("slice_index", "process_index"):
    marks = [[getattr(d, key, 0) or 0 for d in g] for g in groups]
    runs = {len(list(r)) for g in marks for _, r in itertools.groupby(g)}
    if runs == {group}:
      continue  # one node per group by this key; try the next
    if len(runs) == 1:
      return runs.pop()
    return None
  return None
