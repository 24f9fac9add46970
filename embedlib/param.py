"""A ShardedEmbed's parameter as ``nnx.Embed`` code reads it: the logical table.

The table is stored physical: padded to the shard group and laid out over
the mesh (``embedlib.table``). Code written for ``nnx.Embed`` reads and
writes the parameter itself (``x @ emb.embedding[...].T``,
``emb.embedding.set_value(table)``, ``nnx.bridge.to_linen``) and must see
the logical ``[num_embeddings, features]`` table, never the padding.

The parameter stays a plain ``nnx.Param`` (Linen's ``params`` collection,
``nnx.Param`` filters and ``type(v) is nnx.Param`` all hold) with three
metadata hooks, module functions here, and a ``table_layout``
(``TableLayout``: plan and mesh) they read:

- ``on_get_value``: ``[...]``, ``.value``, ``get_value()``, ``.shape``,
  ``nnx.state`` leaves and gradients give the logical view
  (``table.unpad``); an abstract one (``nnx.eval_shape``) a logical
  ``ShapeDtypeStruct``. Only a value of the physical shape is cut; anything
  else (an indexed read, a ``PartitionSpec``) is returned as it is.
- ``on_set_value``: ``set_value`` / ``[...] =`` take the logical table,
  checked and laid out by ``table.load`` as ``load_table`` does; any other
  shape (an indexed write too) raises ``ValueError``.
- ``on_create_value``: a variable built from a logical value with this
  metadata (``nnx.Optimizer``'s slots, which flax builds from
  ``get_value()``; EMA copies; a Linen round trip) is padded back to the
  physical layout.

The raw value (``get_raw_value()``: what ``nnx.split``, ``nnx.jit``,
``nnx.as_pure``, optax, the sparse optimizers and checkpoints use) stays the
physical array; reads inside the library go through ``physical``. A table
whose physical layout is its logical one gets no hooks at all.

Limits of hooks (flax calls them after indexing and before an index write):
an indexed read sees the stored table, indexed; the hook cuts the padding
off what it can recognise (rows read by id, ``embedding[ids]``; 2-D reads
over every row, ``embedding[:, :k]``), but a negative index or a read of
one column (``embedding[-1]``, ``embedding[:, j]``) indexes the stored
table: index the logical one, ``emb.embedding[...][rows]``. Attributes read
off the raw array (``.T``, ``.sharding``, ``.size``) are physical. A stack (``plan.placement``)
whose padded shape equals its logical one can't tell a logical value from
a physical one by shape: values of that shape are taken as physical. A raw
value set to the logical table without hooks (``nnx.update`` after
``nnx.replace_by_pure_dict`` of ``nnx.to_pure_dict``'s logical arrays, or
Linen's ``apply``) is padded on the fly by every lookup (``physical``) and
stored back padded by a sparse optimizer step; optax through
``nnx.Optimizer`` needs the stored shape, so lay it out again first:
``emb.load_table(emb.embedding[...])``.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import variablelib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import table as table_lib

LAYOUT = "table_layout"  # the metadata key of a parameter's TableLayout
_DEPRECATED_HOOKS = "Variable hooks are deprecated"


@dataclasses.dataclass(frozen=True)
class TableLayout:
  """What the hooks need: the table's plan and mesh (hashable, as metadata must be)."""

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


def logical_view(variable, value):
  """``on_get_value``: a physical table as its logical view; an indexed read cut to it."""
  layout = variable.get_metadata(LAYOUT)
  if not layout.is_physical(value):
    return _cut_indexed(layout, value)
  if _is_array(value):
    return table_lib.unpad(value, layout.plan, layout.mesh)
  if isinstance(value, jax.ShapeDtypeStruct):  # an abstract module (nnx.eval_shape)
    return jax.ShapeDtypeStruct(layout.plan.logical_shape, value.dtype,
                                sharding=_logical_sharding(layout))
  return value


def _cut_indexed(layout, value):
  """An indexed read of the stored table (flax indexes before this hook) without its padding.

  Rows read by id (``embedding[ids]``, ``embedding[i]``) are the logical
  rows with the padded columns after them: those are cut. A 2-D read over
  every stored row (``embedding[:, :k]``) loses the padded rows.
  """
  if not _is_array(value) or layout.plan.placement is not None or value.ndim == 0:
    return value
  (rows, cols), (n, f) = layout.plan.padded_shape, layout.plan.logical_shape
  if cols != f and value.shape[-1] == cols and (value.ndim >= 2 or rows != cols):
    value = value[..., :f]
  if rows != n and value.ndim == 2 and value.shape[0] == rows:
    value = value[:n]
  return value


def _logical_sharding(layout):
  if layout.mesh is None:
    return None
  return NamedSharding(layout.mesh, P(*layout.plan.logical_spec))


def load_logical(variable, value):
  """``on_set_value``: the logical table, checked, cast and laid out physical."""
  layout = variable.get_metadata(LAYOUT)
  if isinstance(value, jax.ShapeDtypeStruct):
    return _abstract_physical(layout, value)
  # The stored dtype is param_dtype (np.dtype is falsy: no `or` here).
  dtype = getattr(variable.get_raw_value(), "dtype", None)
  dtype = np.dtype(jnp.asarray(value).dtype if dtype is None else dtype)
  plan = layout.plan
  if _shape(value) != tuple(plan.logical_shape) and _shape(value) is not None:
    raise ValueError(
        f"{plan.name}: embedding.set_value got a table of shape {_shape(value)}, "
        f"expected the logical shape {tuple(plan.logical_shape)} (num_embeddings, "
        f"features; stored padded to {tuple(plan.padded_shape)}, which user code "
        f"never sees); pass the unpadded table. An indexed write (emb.embedding[rows] "
        f"= x) can't be laid out piecewise: write the whole table, "
        f"emb.embedding[...] = emb.embedding[...].at[rows].set(x)."
    )
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


def pad_created(variable, value):
  """``on_create_value``: a variable made from a logical value is stored physical.

  The padding is zero, as ``load`` lays it out. For an optimizer slot of
  the table (flax builds ``nnx.Optimizer``'s slots from the parameter's
  ``get_value()``) that is what optax puts there for zero-initialised slots
  (Adam's moments); a slot optax starts at a constant (Adagrad's
  accumulator) gets zeros in the padding instead, which is harmless:
  padded rows get no gradient, so their updates stay zero (optax's ``eps``
  keeps ``0 / sqrt(0)`` out).
  """
  layout = variable.get_metadata(LAYOUT)
  if not (_is_array(value) or isinstance(value, np.ndarray)) or not layout.is_logical(value):
    return value
  return table_lib.load(value, layout.plan, layout.mesh, np.dtype(value.dtype))


def make(value, plan, mesh, metadata) -> nnx.Param:
  """The ``nnx.Param`` holding physical table ``value`` (or a flax metadata box of it).

  With the hooks above unless the layout is the identity. A user's hooks
  (``embedding_metadata`` or the initializer's box) run on the logical
  values, as they would on ``nnx.Embed``'s table.
  """
  layout = TableLayout(plan, mesh)
  metadata = dict(metadata)
  if layout.identity:
    return nnx.Param(value, **metadata)
  box = value if isinstance(value, variablelib.VariableMetadata) else None
  theirs = lambda key: _hooks(metadata.get(key) or getattr(box, key, ()))
  metadata.update({
      LAYOUT: layout,
      "on_get_value": (logical_view,) + theirs("on_get_value"),
      "on_set_value": theirs("on_set_value") + (load_logical,),
      "on_create_value": theirs("on_create_value") + (pad_created,),
  })
  with warnings.catch_warnings():
    # flax asks for a Variable subclass instead; but Linen's collection and
    # user code key on nnx.Param itself, so hooks it is (module docstring).
    warnings.filterwarnings("ignore", message=_DEPRECATED_HOOKS)
    return nnx.Param(value, **metadata)


def _hooks(found) -> tuple:
  return (found,) if callable(found) else tuple(found)


# -- the raw (physical) table -------------------------------------------------


def physical(variable, plan=None, mesh=None):
  """The physical table of ``variable`` (its raw value), for the library's own reads.

  A logical-shaped raw value (Linen hands the logical table back through
  ``nnx.update``, which sets raw values) is padded on the fly. Any other
  variable (an optimizer slot) gives its raw value.
  """
  raw = variable.get_raw_value()
  if variablelib.is_array_ref(raw):
    raw = raw[...]
  layout = variable.get_metadata(LAYOUT, None)
  if layout is None and plan is not None:
    layout = TableLayout(plan, mesh)
  if layout is not None and _is_array(raw) and layout.is_logical(raw):
    return table_lib.load(raw, layout.plan, layout.mesh, np.dtype(raw.dtype))
  return raw


def set_physical(variable, value) -> None:
  """Stores physical ``value`` as ``variable``'s raw value (no hooks run)."""
  raw = variable.get_raw_value()
  if variablelib.is_array_ref(raw):
    raw[...] = value
  else:
    variable.set_raw_value(value)
