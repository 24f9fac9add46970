"""A ShardedEmbed's parameter as ``nnx.Embed`` code reads it: the logical table.

The table is stored physical: padded to the shard group and laid out over
the mesh (``embedlib.table``). Code written for ``nnx.Embed`` reads and
writes the parameter itself (``x @ emb.embedding[...].T``,
``emb.embedding.T``, ``emb.embedding.set_value(table)``,
``nnx.bridge.to_linen``) and must see the logical
``[num_embeddings, features]`` table, never the padding.

A padded table's parameter is a ``TableParam``: a ``Variable`` type of its
own (flax's way to change how a variable reads and writes), a subclass of
``nnx.Param`` so ``nnx.Param`` filters and ``nnx.Optimizer(wrt=nnx.Param)``
take it, and filed under Linen's ``params`` collection by
``nnx.bridge.to_linen``. It carries a ``table_layout`` (``TableLayout``:
plan and mesh) in its metadata; every read is logical:

- ``get_value()``, ``[...]``, ``.value``, ``nnx.state`` leaves and
  gradients (the same type, holding a gradient of the stored table) give
  the logical view (``table.unpad``); any index (``[ids]``, ``[-1]``,
  ``[:, j]``) indexes that view; ``.shape``, ``.size``, ``.T``,
  ``.sharding``, arithmetic and every other array attribute read it too.
  An abstract table (``nnx.eval_shape``) reads as a logical
  ``ShapeDtypeStruct``.
- ``set_value`` / ``[...] =`` take the logical table, checked and laid out
  by ``table.load`` as ``load_table`` does; any other shape (an indexed
  write too) raises ``ValueError``.
- A ``TableParam`` built from a logical value (a Linen round trip, a copy a
  user builds) is padded back to the physical layout (``create_value``).

The view's layout. Inside a traced program on Auto axes it is the stored
table's layout, uneven shards included (the padding is cut from the last
shard in place; ``with_sharding_constraint`` keeps it). A concrete
``jax.Array`` (an eager read) or an Explicit-axes type can't be split
unevenly (jax refuses an indivisible ``NamedSharding`` there), so an eager
view is laid out by ``EmbeddingPlan.logical_spec``: the even split over the
most devices of the table's axes, replicated when none divides a size.

The raw value (``get_raw_value()``: what ``nnx.split``, ``nnx.jit``,
``nnx.as_pure``, optax, the sparse optimizers and checkpoints use) stays the
physical array; reads inside the library go through ``physical``.
``nnx.Optimizer`` builds its slots as ``OptVariable(slot.get_value(),
**metadata)`` from copies of this type holding optax's physical slots; that
one read gives the stored array (``_compat.building_opt_state``), so the
slots have the table's shape and sharding. A table whose physical layout is
its logical one stays a plain ``nnx.Param``.

Limits: a stack (``plan.placement``) whose padded shape equals its logical
one can't tell a logical value from a physical one by shape: values of that
shape are taken as physical. A raw value set to the logical table without
``set_value`` (``nnx.update`` after ``nnx.replace_by_pure_dict`` of
``nnx.to_pure_dict``'s logical arrays, or Linen's ``apply``) is padded on
the fly by every lookup (``physical``) and stored back padded by a sparse
optimizer step; optax through ``nnx.Optimizer`` needs the stored shape, so
lay it out again first: ``emb.load_table(emb.embedding[...])``.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import variablelib
from flax.typing import MISSING
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import _compat
from embedlib import sharding as sharding_lib
from embedlib import table as table_lib

LAYOUT = "table_layout"  # the metadata key of a parameter's TableLayout
# How numpy and other libraries read an array (np.asarray(emb.embedding)): the view.
_ARRAY_PROTOCOLS = ("__array__", "__array_interface__", "__array_struct__",
                    "__dlpack__", "__dlpack_device__")


@dataclasses.dataclass(frozen=True)
class TableLayout:
  """What a ``TableParam`` reads: the table's plan and mesh (hashable, as metadata must be)."""

  plan: object
  mesh: object = None

  @property
  def identity(self) -> bool:
    """Whether the physical table is the logical one (no padding, no stack)."""
    return self.plan.placement is None and self.plan.padded_shape == self.plan.logical_shape

  def is_physical(self, value) -> bool:
    return _shape(value) == tuple(self.plan.padded_shape)

  def is_logical(self, value) -> bool:
    # A stack of equal shapes is taken as physical (see the module docstring).
    return (_shape(value) == tuple(self.plan.logical_shape)
            and self.plan.padded_shape != self.plan.logical_shape)


def _shape(value):
  shape = getattr(value, "shape", None)
  return None if shape is None else tuple(shape)


def _is_array(value) -> bool:
  return isinstance(value, jax.Array)


class _InParams(type(nnx.Param)):
  """``TableParam``'s metaclass: Linen files it under ``params``, as ``nnx.Param``.

  flax maps a variable type to its Linen collection by equality with the
  registered types (``variable_name_from_type``), one type per name, so a
  subclass would get a collection of its own; ``params`` must keep
  ``nnx.Param`` (Linen's params become ``nnx.Param``). Comparing equal to
  ``nnx.Param`` files the table under ``params`` and lets a Linen round
  trip rebuild it as a ``TableParam``. Hashes stay per type.
  """

  def __eq__(cls, other):
    return True if other is nnx.Param else super().__eq__(other)

  __hash__ = type(nnx.Param).__hash__


class TableParam(nnx.Param, metaclass=_InParams):
  """A padded table's parameter: stored physical, read logical (module docstring)."""

  @classmethod
  def _new(cls, value, metadata):
    """Unflattened (``nnx.eval_shape``'s abstract module too): an abstract table keeps its layout.

    ``jax.eval_shape`` on Auto axes hands back the padded table it traced
    without a sharding, and a program compiled from the abstract module
    would hold the table whole on every device.
    """
    layout = metadata.get(LAYOUT)
    if (isinstance(value, jax.ShapeDtypeStruct) and value.sharding is None
        and layout is not None and layout.mesh is not None and layout.is_physical(value)):
      value = jax.ShapeDtypeStruct(value.shape, value.dtype,
                                   sharding=table_lib.physical_sharding(layout.plan, layout.mesh))
    return super()._new(value, metadata)

  @property
  def table_layout(self) -> TableLayout:
    return self._var_metadata[LAYOUT]

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.table_layout.plan.logical_shape)

  def get_value(self, *, index=MISSING):
    raw = _raw(self)
    if index is MISSING and _compat.building_opt_state(sys._getframe(1)):
      value = raw  # an optimizer slot: the stored layout (module docstring)
    else:
      value = _logical(raw, self.table_layout)
      if index is not MISSING and index is not Ellipsis:
        value = _index(value, index, self.table_layout)
    return _run_hooks(self, "on_get_value", value)

  def set_value(self, value, *, index=MISSING):
    value = _run_hooks(self, "on_set_value", value)
    if index is not MISSING and index is not Ellipsis:
      raise ValueError(_indexed_write(self.table_layout.plan, value))
    value = _load_logical(self, value)
    raw = self._raw_value
    if variablelib.is_array_ref(raw):
      raw[...] = value
    else:
      self._raw_value = value

  def create_value(self, value):
    """A value given as the logical table (a Linen round trip, a user's copy) is stored physical.

    The padding is zero, as ``load`` lays it out.
    """
    layout = self._var_metadata.get(LAYOUT)
    if layout is None or not layout.is_logical(value):
      return value
    if isinstance(value, jax.ShapeDtypeStruct):
      return _abstract_physical(layout, value)
    if not (_is_array(value) or isinstance(value, np.ndarray)):
      return value
    return table_lib.load(value, layout.plan, layout.mesh, np.dtype(value.dtype))

  def __getattr__(self, name):
    metadata = object.__getattribute__(self, "_var_metadata")
    if name in metadata:
      return metadata[name]
    if LAYOUT not in metadata or (name.startswith("__") and name not in _ARRAY_PROTOCOLS):
      return getattr(object.__getattribute__(self, "_raw_value"), name)
    plan = metadata[LAYOUT].plan
    if name == "dtype":
      return _raw(self).dtype
    if name == "ndim":
      return len(plan.logical_shape)
    if name == "size":
      return int(np.prod(plan.logical_shape))
    return getattr(self.get_value(), name)  # .T, .sharding, .at, .astype, ...


def _raw(variable):
  raw = variable.get_raw_value()
  return raw[...] if variablelib.is_array_ref(raw) else raw


def _run_hooks(variable, key, value):
  """A user's own hooks (``embedding_metadata``, an initializer's box), run as flax runs them."""
  hooks = variable._var_metadata.get(key) or ()  # pylint: disable=protected-access
  for hook in (hooks,) if callable(hooks) else hooks:
    value = hook(variable, value)
  return value


def _logical(raw, layout):
  """The logical view of physical ``raw`` (a logical raw value is returned as it is)."""
  plan, mesh = layout.plan, layout.mesh
  if not layout.is_physical(raw):
    return raw
  if isinstance(raw, jax.ShapeDtypeStruct):  # an abstract module (nnx.eval_shape)
    return jax.ShapeDtypeStruct(plan.logical_shape, raw.dtype, sharding=_logical_sharding(layout))
  if not _is_array(raw):
    return raw
  if (isinstance(raw, jax.core.Tracer) and mesh is not None and plan.placement is None
      and not sharding_lib.is_explicit(mesh, mesh.axis_names)):
    # In a program on Auto axes the view may be split unevenly: it stays
    # where the stored table is, each shard cut in place.
    n, f = plan.logical_shape
    return jax.lax.with_sharding_constraint(
        raw[:n, :f], table_lib.physical_sharding(plan, mesh))
  return table_lib.unpad(raw, plan, mesh)


def _index(view, index, layout):
  """``view[index]``; on Explicit axes gathered onto every device.

  On Explicit axes jax can't infer the layout of most reads from a split
  array (one column, a slice, rows by id) and asks for one: the result,
  a part of the table, is replicated.
  """
  mesh = layout.mesh
  if mesh is None or not sharding_lib.is_explicit(mesh, mesh.axis_names):
    return view[index]
  return view.at[index].get(out_sharding=NamedSharding(mesh, P()))


def _logical_sharding(layout):
  if layout.mesh is None:
    return None
  return NamedSharding(layout.mesh, P(*layout.plan.logical_spec))


def _indexed_write(plan, value) -> str:
  return (
      f"{plan.name}: embedding.set_value got a table of shape {_shape(value)}, "
      f"expected the logical shape {tuple(plan.logical_shape)} (num_embeddings, "
      f"features; stored padded to {tuple(plan.padded_shape)}, which user code "
      f"never sees); pass the unpadded table. An indexed write (emb.embedding[rows] "
      f"= x) can't be laid out piecewise: write the whole table, "
      f"emb.embedding[...] = emb.embedding[...].at[rows].set(x)."
  )


def _load_logical(variable, value):
  """The logical table ``value``, checked, cast and laid out physical."""
  layout = variable.table_layout
  if isinstance(value, jax.ShapeDtypeStruct):
    return _abstract_physical(layout, value)
  # The stored dtype is param_dtype (np.dtype is falsy: no `or` here).
  dtype = getattr(_raw(variable), "dtype", None)
  dtype = np.dtype(jnp.asarray(value).dtype if dtype is None else dtype)
  plan = layout.plan
  if _shape(value) != tuple(plan.logical_shape) and _shape(value) is not None:
    raise ValueError(_indexed_write(plan, value))
  table = table_lib.check_host_table(value, plan, dtype, what="embedding.set_value")
  return table_lib.load(table, layout.plan, layout.mesh, dtype)


def _abstract_physical(layout, value):
  """An abstract table (``nnx.eval_shape`` sets one) as the physical one it stands for."""
  if layout.is_physical(value):
    return value
  if not layout.is_logical(value):
    raise ValueError(
        f"{layout.plan.name}: embedding.set_value got an abstract table of shape "
        f"{_shape(value)}, expected the logical shape {tuple(layout.plan.logical_shape)}.")
  sharding = None if layout.mesh is None else table_lib.physical_sharding(
      layout.plan, layout.mesh)
  return jax.ShapeDtypeStruct(layout.plan.padded_shape, value.dtype, sharding=sharding)


def make(value, plan, mesh, metadata) -> nnx.Param:
  """The parameter holding physical table ``value`` (or a flax metadata box of it).

  A ``TableParam`` unless the layout is the identity (then a plain
  ``nnx.Param``, as ``nnx.Embed``'s). A user's hooks (``embedding_metadata``
  or the initializer's box) run on the logical values, as they would on
  ``nnx.Embed``'s table.
  """
  layout = TableLayout(plan, mesh)
  if layout.identity:
    return nnx.Param(value, **metadata)
  return TableParam(value, **{**metadata, LAYOUT: layout})


# -- the raw (physical) table -------------------------------------------------


def physical(variable, plan=None, mesh=None):
  """The physical table of ``variable`` (its raw value), for the library's own reads.

  A logical-shaped raw value (Linen hands the logical table back through
  ``nnx.update``, which sets raw values) is padded on the fly. Any other
  variable (an optimizer slot) gives its raw value.
  """
  raw = _raw(variable)
  layout = variable.get_metadata(LAYOUT, None)
  if layout is None and plan is not None:
    layout = TableLayout(plan, mesh)
  if layout is not None and _is_array(raw) and layout.is_logical(raw):
    return table_lib.load(raw, layout.plan, layout.mesh, np.dtype(raw.dtype))
  return raw


def logical(variable):
  """The logical view of ``variable``, for any variable that carries a table layout.

  A ``TableParam`` reads logical already; an optax slot ``nnx.Optimizer``
  built from one (an ``OptVariable`` with the table's ``table_layout`` in its
  metadata) holds the padded array and reads it as it is. A checkpoint stores
  both logical, so a restore onto another device count (other padding) fits
  them; ``physical`` pads either back. Any other variable gives its value.
  """
  layout = variable.get_metadata(LAYOUT, None)
  if layout is None or isinstance(variable, TableParam):
    return variable.get_value()  # a TableParam's runs the user's hooks, as any read does
  return _logical(_raw(variable), layout)


def set_physical(variable, value) -> None:
  """Stores physical ``value`` as ``variable``'s raw value (no reads or writes of the view)."""
  raw = variable.get_raw_value()
  if variablelib.is_array_ref(raw):
    raw[...] = value
  else:
    variable.set_raw_value(value)
