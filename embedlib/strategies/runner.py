"""The one runner of every strategy: token padding, placement, ``shard_map`` and restore.

The strategy functions see local shards only. ``run`` gives them their
inputs: it pads the token (batch) dimension of the ids (and weights) to a
multiple of the data shards (with invalid ids, which look up zeros), lays
them and the table out as the plan says, runs the body inside
``jax.shard_map`` and strips the padding from its outputs, which take the
batch split of the ids. ``keep`` runs a body whose outputs stay on the
devices that made them (``PerDevice``: a lookup's distributed state, read by
a later program's ``run``); ``per_shard`` maps a body over the data shards
of arrays already padded; ``shard`` is ``shard_map`` itself, outside the
context mesh.
"""

from __future__ import annotations

import typing as tp

import jax
from flax import struct
from jax.sharding import PartitionSpec as P

from embedlib import _compat
from embedlib import sharding as sharding_lib


def token_spec(plan) -> P:
  """The layout of ids and rows inside a lookup: tokens split over the data axes."""
  return P(plan.data_axes or None)


def table_spec(plan) -> P:
  """The physical table's layout."""
  return P(*plan.table_spec)


def split_tokens(x, fill, *, plan, mesh):
  """``x`` padded to a multiple of the data shards with ``fill``, laid out by tokens."""
  return sharding_lib.place(sharding_lib.pad_tokens(x, plan.data_shards, fill), mesh,
                            token_spec(plan))


def restore(x, tokens: int, spec, *, mesh):
  """``x`` without its token padding, split like the ids (``sharding.restore_tokens``)."""
  return sharding_lib.restore_tokens(x, tokens, mesh, spec)


def shard(body, args, in_specs, out_specs, *, mesh, check_vma=True):
  """``jax.shard_map(body)(*args)`` outside the context mesh (``sharding.no_context_mesh``)."""
  with sharding_lib.no_context_mesh():
    return _compat.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=check_vma)(*args)


@struct.dataclass
class PerDevice:
  """Values made inside ``shard_map``, kept per device between two programs.

  Each leaf is ``[devices along the axes it varies over, ...]``, split over
  those axes (``specs``), so a later ``shard_map`` hands every device back
  its own value, typed as varying over the same axes.

  Attributes:
    leaves: the values' leaves.
    specs: each leaf's layout.
    treedef: the values' structure.
    meta: static ``(name, value)`` pairs the later program reads.
  """

  leaves: tuple
  specs: tuple = struct.field(pytree_node=False)
  treedef: tp.Any = struct.field(pytree_node=False)
  meta: tuple = struct.field(pytree_node=False, default=())

  def local(self, leaves):
    """The body's values from this device's ``leaves`` (inside ``shard_map``)."""
    return jax.tree.unflatten(self.treedef, [x[0] for x in leaves])


def run(body, table, tokens, fill, *, plan, mesh, state: PerDevice | None = None,
        like=None, width: int | None = None, count: bool = False, out_spec=None,
        check_vma=True):
  """``body(table_shard, tokens_shard[, leaves])`` over the mesh: a lookup's one program.

  Args:
    body: the shard_map body; returns token-split outputs (a pytree), or
      ``(outputs, count)`` with ``count`` a ``[1]`` array when ``count``.
    table: the physical table, ``plan.padded_shape``.
    tokens: a pytree of arrays sharing their leading (token) dimension.
    fill: the padding value of each leaf of ``tokens`` (same structure).
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh, or None for one device (``body`` runs as is).
    state: a ``keep`` result from an earlier program: ``body`` gets this
      device's ``leaves`` of it, and reads them with ``state.local(leaves)``.
    like: the array whose batch the outputs take (default: ``tokens``'
      first leaf).
    width: keep the first ``width`` entries of the outputs' last dimension
      (drops padded columns or logits).
    count: ``body`` also returns a per-device count; its largest value is
      returned beside the outputs.
    out_spec: the outputs' layout when not split by tokens alone; the token
      padding is then dropped keeping it.
    check_vma: shard_map's type check; off only for the Pallas interpreter
      (``kernels.shard_map_check_vma``).

  Returns:
    The outputs, without token padding; ``(outputs, largest count)`` with
    ``count``.
  """
  cut = (lambda x: x) if width is None else (lambda x: x[..., :width])
  if mesh is None:
    return jax.tree.map(cut, body(table, tokens))
  like = jax.tree.leaves(tokens)[0] if like is None else like
  batch = like.shape[0]
  spec = sharding_lib.leading_spec(like, mesh)
  tokens = jax.tree.map(lambda a, f: split_tokens(a, f, plan=plan, mesh=mesh), tokens, fill)
  table = sharding_lib.place(table, mesh, table_spec(plan))
  args, in_specs = (table, tokens), (table_spec(plan), token_spec(plan))
  if state is not None:
    args, in_specs = args + (state.leaves,), in_specs + (state.specs,)
  out_specs = token_spec(plan) if out_spec is None else out_spec
  if count:
    out_specs = (out_specs, token_spec(plan))
  out = shard(body, args, in_specs, out_specs, mesh=mesh, check_vma=check_vma)
  if out_spec is not None:
    if out.shape[0] != batch:
      # Slicing a split dimension is not allowed on Explicit axes: gather the
      # (uneven) tokens, never the other dimensions.
      out = sharding_lib.place(out, mesh, P(None, *out_spec[1:]))[:batch]
    return out
  if count:
    out, counts = out
    return tuple(cut(restore(o, batch, spec, mesh=mesh)) for o in out), counts.max()
  return jax.tree.map(lambda o: cut(restore(o, batch, spec, mesh=mesh)), out)


def keep(body, tokens, fill, *, plan, mesh, table=None, meta=(), check_vma=True) -> PerDevice:
  """``body(tokens_shard[, table_shard])`` over ``mesh``; its outputs kept per device.

  The first half of a lookup run ahead (``PerDevice``): ``run`` hands each
  device its values back in a later program.
  """
  tokens = jax.tree.map(lambda a, f: split_tokens(a, f, plan=plan, mesh=mesh), tokens, fill)
  args, in_specs = (tokens,), (token_spec(plan),)
  if table is not None:
    args, in_specs = args + (sharding_lib.place(table, mesh, table_spec(plan)),), in_specs + (
        table_spec(plan),)
  axes = tuple(mesh.axis_names)
  found = []

  def probe(*a):
    leaves, treedef = jax.tree.flatten(body(*a))
    varying = [sharding_lib.varying_axes(x) if check_vma else frozenset(axes) for x in leaves]
    found.append((tuple(tuple(n for n in axes if n in v) for v in varying), treedef))
    return tuple(x[None] for x in leaves)

  with sharding_lib.no_context_mesh():
    # Traced once for the axes each output varies over (no computation).
    jax.eval_shape(_compat.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=P(axes),
                                     check_vma=check_vma), *args)
  varying, treedef = found[-1]
  specs = tuple(P(v or None) for v in varying)
  leaves = shard(lambda *a: tuple(x[None] for x in jax.tree.leaves(body(*a))), args, in_specs,
                 specs, mesh=mesh, check_vma=check_vma)
  return PerDevice(tuple(leaves), specs, treedef, meta)


def per_shard(body, args, *, plan, mesh, check_vma=True):
  """``body(*args)`` on each data shard of ``args`` (all padded, split on dim 0)."""
  if mesh is None:
    return body(*args)
  spec = token_spec(plan)
  args = jax.tree.map(lambda a: sharding_lib.place(a, mesh, spec), args)
  return shard(body, args, spec, spec, mesh=mesh, check_vma=check_vma)
