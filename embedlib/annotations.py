"""The sharding annotations Flax code writes for ``nnx.Embed``, read as a layout.

Flax models say how an embedding table is laid out in one of two places:
``embedding_metadata={'out_sharding': spec}`` (flax's Gemma example) or
``embedding_init=nnx.with_partitioning(init, axes)`` (its lm1b example); the
axes are mesh axis names, or logical names that ``nnx.logical_axis_rules``
(the same context as linen's ``nn.logical_axis_rules``) and the variable's
own ``sharding_rules`` map to mesh axes. ``ShardedEmbed`` takes them as its
layout request: mesh axes on the vocabulary dimension mean vocab sharding
over them, on the feature dimension hidden sharding; an annotation naming no
mesh axis (None, ``P()``, logical names the rules map to None) leaves the
choice to ``sharding="auto"``. Explicit ``sharding=`` / ``table_axes=`` win,
and must not contradict the annotation.

The parameter keeps the annotation's metadata with the physical spec in
``out_sharding``, so ``nnx.get_partition_spec`` and
``nnx.get_named_sharding`` give the table's real layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
from flax.core import spmd as flax_spmd
from flax.nnx import variablelib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import options


def unwrap(value):
  """The array inside a flax ``VariableMetadata`` box (what ``with_partitioning`` returns)."""
  return value.raw_value if isinstance(value, variablelib.VariableMetadata) else value


def init_box(init, key, shape, dtype, *, name: str):
  """The flax metadata box ``init`` wraps its table in (``with_partitioning``), or None.

  Traced abstractly (no table is drawn); also checks the shape ``init``
  returns.
  """
  found = {}

  def probe(k):
    out = init(k, shape, dtype)
    if isinstance(out, variablelib.VariableMetadata):
      found["box"] = dataclasses.replace(out, raw_value=None)
    return unwrap(out)

  got = jax.eval_shape(probe, key)
  if tuple(got.shape) != tuple(shape):
    raise ValueError(
        f"{name}: embedding_init returned shape {tuple(got.shape)} for the logical "
        f"shape {tuple(shape)} (num_embeddings, features); it must return an array "
        f"of the shape it is given, as init(key, shape, dtype)."
    )
  return found.get("box")


@dataclasses.dataclass(frozen=True)
class Annotation:
  """The layout a Flax annotation asks for.

  ``sharding`` is ``"vocab"``, ``"hidden"``, ``"grid"`` (axes on both
  dimensions: rows over ``table_axes``, columns over ``column_axes``) or
  ``"auto"`` (no mesh axis named); ``where`` spells the annotation for error
  messages.
  """

  sharding: str
  table_axes: tuple[str, ...] | None
  where: str
  mesh: object = None
  column_axes: tuple[str, ...] = ()


def find(embedding_metadata: Mapping, init_box) -> tuple | None:
  """``(out_sharding, sharding_rules, mesh, where)`` of the annotation, or None.

  An initializer's box wins over ``embedding_metadata``, as in ``nnx.Param``.
  """
  for meta, where in (
      (getattr(init_box, "metadata", None) or {}, "embedding_init=nnx.with_partitioning(...)"),
      (embedding_metadata, "embedding_metadata"),
  ):
    if "out_sharding" in meta:
      spec = meta["out_sharding"]
      rules = meta.get("sharding_rules") or ()
      mesh = meta.get("mesh")
      return spec, rules, mesh, f"{where} out_sharding={spec!r}"
  return None


def read(found, mesh_axes: tuple[str, ...] | None, *, name: str) -> Annotation | None:
  """The layout request of an annotation (``find``'s result) on a mesh's axes.

  Args:
    found: ``(out_sharding, sharding_rules, mesh, where)`` or None.
    mesh_axes: the axis names of the module's mesh, or None without one.
    name: the table's name, for errors.

  Raises:
    ValueError: an axis the mesh doesn't have, one axis on both dimensions,
      more than two dimensions, or mesh axes with no mesh.
  """
  if found is None:
    return None
  spec, local_rules, mesh, where = found
  if isinstance(spec, NamedSharding):
    mesh = spec.mesh
    spec = spec.spec
  if spec is None:
    return Annotation(options.AUTO, None, where, mesh)
  entries = tuple(spec)
  if len(entries) > 2:
    raise ValueError(
        f"{name}: {where} has {len(entries)} entries, but the table has two "
        f"dimensions (num_embeddings, features); e.g. out_sharding=P('model', None)."
    )
  rules = dict(flax_spmd.composite_rules(flax_spmd.get_logical_axis_rules(), tuple(local_rules)))
  axes_of = [_mesh_axes(e, rules) for e in entries + (None,) * (2 - len(entries))]
  if mesh_axes is None and mesh is not None:
    mesh_axes = tuple(mesh.axis_names)
  for dim, axes in zip(("num_embeddings", "features"), axes_of):
    for a in axes:
      if mesh_axes is None:
        raise ValueError(
            f"{name}: {where} names mesh axis {a!r} but there is no mesh; pass "
            f"mesh= or build the module under jax.set_mesh(mesh)."
        )
      if a not in mesh_axes:
        raise ValueError(
            f"{name}: {where} puts axis {a!r} on {dim}, which is neither an axis "
            f"of the mesh (its axes are {mesh_axes}) nor a logical name the "
            f"rules map to one (rules: {tuple(rules.items())}); name a mesh axis, or "
            f"map it with nnx.logical_axis_rules([({a!r}, <mesh axis>)])."
        )
  rows, cols = axes_of
  for axes, dim in ((rows, "num_embeddings"), (cols, "features"), (rows + cols, "")):
    twice = sorted({a for a in axes if axes.count(a) > 1})
    if twice:
      on = f"on {dim}" if dim else f"on num_embeddings {rows} and on features {cols}"
      raise ValueError(
          f"{name}: {where} puts mesh axis {twice[0]!r} {on}; a mesh axis splits "
          f"one dimension once: e.g. out_sharding=P('tensor', 'fsdp') for rows over "
          f"'tensor' and columns over 'fsdp'."
      )
  if rows and cols:
    return Annotation(options.GRID, rows, where, mesh, column_axes=cols)
  if rows:
    return Annotation(options.VOCAB, rows, where, mesh)
  if cols:
    return Annotation(options.HIDDEN, cols, where, mesh)
  return Annotation(options.AUTO, None, where, mesh)


def _mesh_axes(entry, rules) -> tuple[str, ...]:
  """Mesh axes of one spec entry, logical names mapped through ``rules``."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  if isinstance(entry, str) and entry in rules:
    return _mesh_axes(rules[entry], {})
  names = (entry,) if isinstance(entry, str) else tuple(entry)
  out = []
  for n in names:
    out.extend(_mesh_axes(rules[n], {}) if n in rules else (n,))
  return tuple(out)


def merge(sharding: str, table_axes, annotation: Annotation | None, *, name: str,
          column_axes=None):
  """``(sharding, table_axes, column_axes)`` from the explicit arguments and the annotation.

  Explicit arguments win where the annotation names no axis; where both
  speak, they must agree.
  """
  if annotation is None or annotation.sharding == options.AUTO:
    return sharding, table_axes, column_axes
  explicit = []
  if sharding != options.AUTO and sharding != annotation.sharding:
    explicit.append(f"sharding={sharding!r}")
  for given, asked, what in ((table_axes, annotation.table_axes, "table_axes"),
                             (column_axes, annotation.column_axes, "column_axes")):
    if given is not None:
      axes = (given,) if isinstance(given, str) else tuple(given)
      if set(axes) != set(asked or ()):
        explicit.append(f"{what}={given!r}")
  if explicit:
    over = f"{annotation.table_axes}" + (
        f" (rows) and {annotation.column_axes} (columns)" if annotation.column_axes else "")
    raise ValueError(
        f"{name}: {' and '.join(explicit)} contradicts {annotation.where}, which "
        f"asks for {annotation.sharding} sharding over {over}; "
        f"drop one of them or make them agree."
    )
  return annotation.sharding, annotation.table_axes, annotation.column_axes or None


class PlainInLinen:
  """How an unannotated table appears in Linen: a plain array, as ``nnx.Embed``'s does.

  ``nnx.bridge.to_linen`` boxes every variable that carries metadata; this
  ``linen_meta_type`` hands it the bare value instead, while NNX tools still
  read the table's layout from ``out_sharding``.
  """

  @staticmethod
  def from_nnx_metadata(metadata):
    return metadata["value"]


def param_metadata(embedding_metadata: Mapping, init_box, *, spec, mesh,
                   annotated: bool) -> tuple[dict, object]:
  """``(metadata, box)`` for the ``nnx.Param``: the user's, with the physical spec.

  ``box`` is the initializer's ``VariableMetadata`` with its ``out_sharding``
  replaced (or None), to be filled with the table and passed to ``nnx.Param``
  as ``nnx.Embed`` passes it, hooks and all.
  """
  metadata = dict(embedding_metadata)
  if mesh is not None:
    metadata.update(out_sharding=spec, mesh=mesh)
    if not annotated:
      metadata.setdefault("linen_meta_type", PlainInLinen)
    if "eager_sharding" not in metadata and "eager_sharding" not in getattr(
        init_box, "metadata", {}):
      # The table is already laid out as out_sharding says; flax's eager
      # placement would copy it (a second table-sized buffer).
      metadata["eager_sharding"] = False
  if init_box is not None and "out_sharding" in init_box.metadata and mesh is not None:
    init_box = dataclasses.replace(
        init_box, metadata={**init_box.metadata, "out_sharding": spec, "mesh": mesh})
  return metadata, init_box
