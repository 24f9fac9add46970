"""A ShardedEmbed's physical table: drawn, loaded and unpadded shard by shard.

Nothing here holds a table whole on one device, or on the host, unless its
layout is replicated:

- ``draw``: one jitted program calls the user's initializer with the
  logical shape (initializers such as ``variance_scaling`` read it) and pads
  in the same program, with the table's sharding as its output sharding.
  With jax's partitionable threefry (``jax_threefry_partitionable``, the
  default) each device draws only its own rows or columns, and the values
  don't depend on the layout. A replicated table is drawn split over the
  mesh and gathered: besides its output, one table-sized buffer (the
  gather's) instead of the draw's three.
- ``load``: a host array (numpy, ``np.memmap``) is read one shard at a time
  (``jax.make_array_from_callback``), padding filled with zeros; a jax
  array is padded and laid out by one jitted program.
- ``unpad``: the logical table, laid out by ``EmbeddingPlan.logical_spec``.
- A stack (``plan.placement``): drawn split by logical rows and moved to
  its physical blocks by static collectives (``strategies.stackmove``);
  loaded from the host block by block, each from the placement's runs in
  it; read back by the same moves in reverse (``unpad``, ``stack_rows``,
  ``stack_members``). A device holds a few blocks, never the stack.

Values: nnx.Embed draws eagerly, one primitive at a time. The jitted draw
gives its values bit for bit on jax 0.10 (on CPU with
``_compat.init_compiler_options``). On jax >= 0.11, XLA:CPU vectorizes the
initializer's transcendental functions over each shard, and a shard whose
size isn't a multiple of the vector width evaluates its tail with other
instructions than the whole table does: a few entries of such tables differ
from the eager ones by an ulp or two (measured: 2 at most). A table drawn
inside the caller's own ``jit`` is rounded as that program rounds, as an
``nnx.Embed`` built there would be.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import _compat
from embedlib import sharding as sharding_lib
from embedlib.plan import mesh_axes
from embedlib.strategies import rowmap
from embedlib.strategies import stackmove


def physical_sharding(plan, mesh) -> NamedSharding:
  return NamedSharding(mesh, P(*plan.table_spec))


def _pad_widths(plan):
  (rows, cols), (n, f) = plan.padded_shape, plan.logical_shape
  return ((0, rows - n), (0, cols - f))


def _platform(mesh) -> str:
  return mesh.devices.flat[0].platform


# -- drawing ----------------------------------------------------------------


def draw(init, key, plan, mesh, dtype, *, unwrap=lambda x: x):
  """The physical table: ``init(key, logical_shape, dtype)``, padded and laid out.

  Args:
    init: the user's initializer.
    key: its PRNG key (concrete, or a tracer under ``jit`` / ``eval_shape``).
    plan: the table's ``EmbeddingPlan``.
    mesh: a ``Mesh``, an ``AbstractMesh`` or None (one device: drawn eagerly,
      exactly as ``nnx.Embed`` draws it).
    dtype: the param dtype.
    unwrap: applied to ``init``'s result (strips flax metadata boxes).

  Returns:
    ``plan.padded_shape``, with sharding ``plan.table_spec`` on ``mesh``.
  """
  if mesh is None:
    table = unwrap(init(key, plan.logical_shape, dtype))
    if plan.placement is not None:
      return rowmap.to_physical(table, plan)
    pad = _pad_widths(plan)
    return jnp.pad(table, pad) if any(p for _, p in pad) else table
  if isinstance(key, jax.core.Tracer) or not sharding_lib.has_devices(mesh):
    return _build(key, init=init, unwrap=unwrap, layout=_Layout.of(plan, mesh), dtype=dtype)
  return program(init, plan, mesh, dtype, unwrap=unwrap)(key)


def program(init, plan, mesh, dtype, *, unwrap=lambda x: x):
  """The jitted draw ``key -> physical table`` on a concrete mesh (what ``draw`` runs).

  One program per initializer and layout; its
  ``.lower(key).compile().memory_analysis()`` shows what a device holds
  while drawing.
  """
  layout = _Layout.of(plan, mesh)
  try:
    return _program(init, unwrap, layout, np.dtype(dtype))
  except TypeError:  # an unhashable initializer: compiled for this table only
    return _program.__wrapped__(init, unwrap, layout, np.dtype(dtype))


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What the draw depends on, without the table's name: one program per layout."""

  logical: tuple[int, int]
  padded: tuple[int, int]
  spec: tuple
  split: tuple  # where a replicated table is drawn before the gather
  mesh: object
  stack: object = None  # a stack's plan: its rows go where its placement says

  @classmethod
  def of(cls, plan, mesh):
    split = (None, None)
    axes = tuple(a for a, n in plan.mesh_shape if n > 1)
    devices = mesh_axes.axes_size(dict(plan.mesh_shape), axes)
    if not plan.table_axes and axes and plan.num_embeddings >= devices:
      split = (axes, None)  # rows over every device; uneven is fine inside a program
    stack = plan if plan.placement is not None else None
    return cls(plan.logical_shape, plan.padded_shape, plan.table_spec, split, mesh, stack)


def _build(key, *, init, unwrap, layout, dtype):
  """The traceable draw: init, pad, laid out as ``layout`` says."""
  (rows, cols), (n, f) = layout.padded, layout.logical
  out = NamedSharding(layout.mesh, P(*layout.spec))
  explicit = sharding_lib.is_explicit(layout.mesh, layout.mesh.axis_names)

  if layout.stack is not None:
    return _build_stack(key, init=init, unwrap=unwrap, layout=layout, dtype=dtype,
                        explicit=explicit)

  def body(key):
    table = unwrap(init(key, layout.logical, dtype))
    if any(layout.split):
      # Replicated: drawn split over the mesh, then gathered. Sharded: the
      # output sharding reaches back through the pad to the draw. Under
      # auto_axes the spec refers to the context's (now Auto) mesh.
      split = P(*layout.split)
      table = jax.lax.with_sharding_constraint(
          table, split if explicit else NamedSharding(layout.mesh, split))
    return jnp.pad(table, ((0, rows - n), (0, cols - f)))

  if explicit:
    # On Explicit axes every op of the initializer would be typed replicated
    # and the whole table drawn on each device; auto axes let the output
    # sharding propagate back to the draw.
    return _compat.auto_axes(body, out_sharding=out)(key)
  return jax.lax.with_sharding_constraint(body(key), out)


def _build_stack(key, *, init, unwrap, layout, dtype, explicit):
  """A stack's draw: its logical rows drawn split over its devices, then moved.

  A gather by physical row (``rowmap.to_physical``) would be partitioned by
  replicating the logical stack on every device; drawn split by rows (the
  same values: threefry is partitionable), each block's rows reach their
  device by static collectives (``stackmove``).
  """
  rows = P(tuple(layout.stack.table_axes) or None, None)

  placement = layout.stack.placement
  split = placement.group * stackmove.logical_rows(placement)

  def body(key):
    table = unwrap(init(key, layout.logical, dtype))
    table = jax.lax.with_sharding_constraint(
        table, rows if explicit else NamedSharding(layout.mesh, rows))
    # Padded to even blocks in the same program (Explicit axes split evenly).
    table = jnp.pad(table, ((0, split - table.shape[0]), (0, 0)))
    return jax.lax.with_sharding_constraint(
        table, rows if explicit else NamedSharding(layout.mesh, rows))

  if explicit:
    table = _compat.auto_axes(body, out_sharding=NamedSharding(layout.mesh, rows))(key)
  else:
    table = body(key)
  return stackmove.to_physical(table, layout.stack, layout.mesh)


@functools.lru_cache(maxsize=64)
def _program(init, unwrap, layout, dtype):
  build = functools.partial(_build, init=init, unwrap=unwrap, layout=layout, dtype=dtype)
  # An initializer that names its own options is compiled with them: a
  # dynamic table's rows must equal the ones its steps draw, which XLA
  # compiles with its default passes, not nnx.Embed's eager values.
  options = getattr(init, "compiler_options", None)
  if options is None:
    options = _compat.init_compiler_options(_platform(layout.mesh))
  return jax.jit(build, out_shardings=NamedSharding(layout.mesh, P(*layout.spec)),
                 compiler_options=dict(options))


# -- loading ----------------------------------------------------------------


def check_host_table(table, plan, param_dtype, *, what="load_table"):
  """``table`` as an array (host arrays stay on the host), validated.

  Raises ValueError naming the table (and ``what`` was called) for a wrong
  shape, a complex or a non-numeric dtype.
  """
  if not isinstance(table, (jax.Array, np.ndarray)):
    table = np.asarray(table)
  name, want = plan.name, plan.logical_shape
  if tuple(table.shape) != want:
    raise ValueError(
        f"{name}: {what} got a table of shape {tuple(table.shape)}, expected the "
        f"logical shape {want} (num_embeddings, features), without padding; "
        f"pass the unpadded table."
    )
  dtype = np.dtype(table.dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    raise ValueError(
        f"{name}: {what} got a complex table ({dtype}), but the table is real "
        f"(param_dtype {np.dtype(param_dtype)}); pass its real part (table.real) "
        f"if that is what you mean."
    )
  if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
    raise ValueError(
        f"{name}: {what} got a table of dtype {dtype}, which is not numeric; "
        f"pass an array of numbers (it is cast to param_dtype "
        f"{np.dtype(param_dtype)})."
    )
  return table


def _may_overflow(src, dst) -> bool:
  dst = np.dtype(dst)
  if not jnp.issubdtype(dst, jnp.inexact) or np.dtype(src) == dst:
    return False
  return float(jnp.finfo(dst).max) < _largest(src)


def _largest(dtype) -> float:
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return float(jnp.finfo(dtype).max)
  if jnp.issubdtype(dtype, jnp.integer):
    return float(jnp.iinfo(dtype).max)
  return 1.0


def _overflow_error(plan, src, dst, value, row):
  return ValueError(
      f"{plan.name}: load_table got {np.dtype(src)} values as large as {value:.6g} "
      f"(row {row}), which overflow param_dtype {np.dtype(dst)} (largest finite "
      f"{float(jnp.finfo(dst).max):.6g}) to inf; scale or clip the table, or build "
      f"the module with a wider param_dtype."
  )


def _cast_block(block, plan, dtype, row0):
  """A host block cast to ``dtype``, refusing finite values that become inf."""
  block = np.asarray(block)
  with np.errstate(over="ignore"):
    out = block.astype(dtype)
  if _may_overflow(block.dtype, dtype):
    bad = np.isfinite(block) & ~np.isfinite(out)
    if bad.any():
      r, c = np.argwhere(bad)[0]
      raise _overflow_error(plan, block.dtype, dtype, abs(float(block[r, c])), row0 + r)
  return out


def load(table, plan, mesh, dtype):
  """The physical table holding ``table`` (validated by ``check_host_table``)."""
  if plan.placement is not None:
    return _load_stack(table, plan, mesh, dtype)
  pad = _pad_widths(plan)
  if isinstance(table, jax.Array):
    return _load_device(table, plan, mesh, dtype, pad)
  if mesh is None:
    return jnp.pad(jnp.asarray(_cast_block(table, plan, dtype, 0)), pad)
  _check_concrete(plan, mesh)
  rows, cols = plan.logical_shape
  padded = plan.padded_shape

  def shard(index):
    r0, r1, _ = index[0].indices(padded[0])
    c0, c1, _ = index[1].indices(padded[1])
    out = np.zeros((r1 - r0, c1 - c0), dtype)
    rn, cn = max(0, min(r1, rows) - r0), max(0, min(c1, cols) - c0)
    if rn and cn:
      out[:rn, :cn] = _cast_block(table[r0:r0 + rn, c0:c0 + cn], plan, dtype, r0)
    return out

  return jax.make_array_from_callback(padded, physical_sharding(plan, mesh), shard)


def _check_concrete(plan, mesh):
  """A host array is placed shard by shard: that needs devices, not an AbstractMesh."""
  if not sharding_lib.has_devices(mesh):
    raise ValueError(
        f"{plan.name}: load_table needs a concrete mesh to place a host array; this "
        f"module was built on an AbstractMesh (build it on a jax.sharding.Mesh)."
    )


def _load_device(table, plan, mesh, dtype, pad):
  traced = isinstance(table, jax.core.Tracer)
  if not traced and _may_overflow(table.dtype, dtype):
    found = _first_overflow(table, np.dtype(dtype))
    if found is not None:
      raise _overflow_error(plan, table.dtype, dtype, *found)
  if mesh is None:
    return jnp.pad(table.astype(dtype), pad)
  out = physical_sharding(plan, mesh)
  if traced or not sharding_lib.has_devices(mesh):
    return sharding_lib.place_always(jnp.pad(table.astype(dtype), pad), out)
  return _pad_onto(pad, out, np.dtype(dtype))(table)


def _load_stack(table, plan, mesh, dtype):
  """A stack's physical table: a host table read block by block, a jax one moved.

  A host table (numpy, ``np.memmap``) fills each device's physical block
  from the placement's runs that land in it, reading only those rows. A jax
  array is cast and its rows moved block to block by static collectives
  (``stackmove``), never gathered whole onto a device (beyond how it came).
  """
  if not isinstance(table, jax.Array):
    if mesh is None:
      return rowmap.to_physical(jnp.asarray(_cast_block(table, plan, dtype, 0)), plan)
    _check_concrete(plan, mesh)
    return jax.make_array_from_callback(
        plan.padded_shape, physical_sharding(plan, mesh),
        functools.partial(_stack_block, table, plan, np.dtype(dtype)))
  if not isinstance(table, jax.core.Tracer) and _may_overflow(table.dtype, dtype):
    found = _first_overflow(table, np.dtype(dtype))
    if found is not None:
      raise _overflow_error(plan, table.dtype, dtype, *found)
  if mesh is None:
    return rowmap.to_physical(table.astype(dtype), plan)
  place = lambda t: stackmove.to_physical(t.astype(dtype), plan, mesh)
  if isinstance(table, jax.core.Tracer) or not sharding_lib.has_devices(mesh):
    return place(table)
  return jax.jit(place, out_shardings=physical_sharding(plan, mesh))(table)


def _stack_block(table, plan, dtype, index):
  """The physical block at ``index`` of a stack, from host ``table``'s runs in it."""
  r0, r1, _ = index[0].indices(plan.padded_shape[0])
  c0, c1, _ = index[1].indices(plan.padded_shape[1])
  out = np.zeros((r1 - r0, c1 - c0), dtype)
  cn = max(0, min(c1, plan.features) - c0)
  for logical, n, physical in plan.placement.segments:
    a, b = max(physical, r0), min(physical + n, r1)
    if a < b and cn:
      first = logical + a - physical
      out[a - r0:b - r0, :cn] = _cast_block(
          table[first:first + b - a, c0:c0 + cn], plan, dtype, first)
  return out


def _first_overflow(table, dtype):
  """``(largest offending magnitude, first row holding one)``, or None."""
  found, row, value = _overflows(table, dtype)
  return (float(value), int(row)) if bool(found) else None


@functools.partial(jax.jit, static_argnums=1)
def _overflows(table, dtype):
  bad = jnp.isfinite(table) & ~jnp.isfinite(table.astype(dtype))
  rows = jnp.any(bad, axis=1)
  value = jnp.max(jnp.where(bad, jnp.abs(table), 0))
  return jnp.any(rows), jnp.argmax(rows), value


@functools.cache
def _pad_onto(pad, sharding, dtype):
  """A jitted cast and ``jnp.pad`` laid out as ``sharding``."""
  return jax.jit(lambda t: jnp.pad(t.astype(dtype), pad), out_shardings=sharding)


# -- unpadding ----------------------------------------------------------------


def unpad(table, plan, mesh, *, replicated: bool = False):
  """The ``(num_embeddings, features)`` table, laid out by ``plan.logical_spec``.

  Args:
    table: the physical table.
    plan: its ``EmbeddingPlan``.
    mesh: its mesh, or None.
    replicated: gather it onto every device instead.
  """
  n, f = plan.logical_shape
  if plan.placement is not None:
    return _unstack(table, plan, mesh, replicated)
  padded = plan.padded_shape != plan.logical_shape
  if mesh is None:
    return table[:n, :f] if padded else table
  if not padded and not replicated:
    return table
  spec = () if replicated else plan.logical_spec
  target = NamedSharding(mesh, P(*spec))
  if isinstance(table, jax.core.Tracer) or not sharding_lib.has_devices(mesh):
    return _cut(table, target, n, f)
  return _cut_onto(target, n, f)(table)


def _cut(table, target, n, f):
  # Resharded first: a split dimension can't be sliced unevenly.
  return sharding_lib.place_always(table, target)[:n, :f]


@functools.cache
def _cut_onto(target, n, f):
  return jax.jit(functools.partial(_cut, target=target, n=n, f=f), out_shardings=target)


def _unstack(table, plan, mesh, replicated):
  """A stack's logical rows, moved block to block (``stackmove``), never gathered whole first.

  Replicated, the result itself is the logical stack on every device (and
  the physical stack is not gathered besides).
  """
  if mesh is None:
    return rowmap.to_logical(table, plan)
  target = NamedSharding(mesh, P() if replicated else P(*plan.logical_spec))
  n = plan.num_embeddings

  def logical(t):
    # Resharded before the cut: a split dimension can't be sliced unevenly.
    return sharding_lib.place_always(stackmove.to_logical(t, plan, mesh), target)[:n]

  if isinstance(table, jax.core.Tracer) or not sharding_lib.has_devices(mesh):
    return logical(table)
  return _unstack_onto(plan, mesh, replicated)(table)


@functools.cache
def _unstack_onto(plan, mesh, replicated):
  target = NamedSharding(mesh, P() if replicated else P(*plan.logical_spec))
  return jax.jit(lambda t: _unstack(t, plan, mesh, replicated), out_shardings=target)


def stack_rows(table, plan, mesh):
  """A stack's logical rows, split by rows over its devices (``stackmove.to_logical``).

  ``[group * logical_rows, features]``: rows past ``num_embeddings`` are
  zero. For cutting members out without the stack whole on a device.
  """
  if mesh is None:
    return rowmap.to_logical(table, plan)
  if isinstance(table, jax.core.Tracer) or not sharding_lib.has_devices(mesh):
    return stackmove.to_logical(table, plan, mesh)
  return _stack_rows_onto(plan, mesh)(table)


@functools.cache
def _stack_rows_onto(plan, mesh):
  rows = NamedSharding(mesh, P(tuple(plan.table_axes) or None, None))
  return jax.jit(lambda t: stackmove.to_logical(t, plan, mesh), out_shardings=rows)


def stack_members(table, plan, mesh, names=None) -> dict:
  """A stack's member tables by name (``names``, default all), each whole on every device.

  Cut from the stack's logical rows split over its devices (``stack_rows``):
  no device holds the stack whole, only its block and the members asked for.
  """
  placement = plan.placement
  members = [(m, n) for m, n in placement.members if names is None or m in names]
  if mesh is None:
    rows = rowmap.to_logical(table, plan)
    return {m: rows[placement.start(m):placement.start(m) + n] for m, n in members}
  rows = stack_rows(table, plan, mesh)
  return {m: _member_onto(plan, mesh, placement.start(m), n)(rows) for m, n in members}


@functools.cache
def _member_onto(plan, mesh, start, length):
  return jax.jit(lambda rows: stackmove.member(rows, plan, mesh, start, length),
                 out_shardings=NamedSharding(mesh, P()))
