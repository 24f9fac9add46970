"""``EmbeddingCollection``: many features over many sharded tables, in one module."""

from __future__ import annotations

import dataclasses
import typing as tp
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn.linear import default_embed_init

from embedlib import _deprecated
from embedlib import kernels
from embedlib import options
from embedlib import sharding as sharding_lib
from embedlib import table as table_lib
from embedlib.collection import inputs as inputs_lib
from embedlib.collection import planner
from embedlib.collection import stacks as stacks_lib
from embedlib.collection.specs import FeatureSpec, TableSpec, validate
from embedlib.dynamic import module as dynamic_module
from embedlib.embed import ShardedEmbed
from embedlib.plan import memory as plan_memory
from embedlib.plan.settings import CollectionLayout, Layout, field_names
from embedlib.strategies import Request
from embedlib.strategies.dedup import ERROR, OVERFLOW_MODES


class EmbeddingCollection(nnx.Module):
  """Embeds a dict of categorical features, each table sharded by its own plan.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from flax import nnx
  >>> from embedlib import CollectionLayout, EmbeddingCollection, FeatureSpec, TableSpec
  >>> mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
  >>> coll = EmbeddingCollection(
  ...     [TableSpec("item", 1000, 16), TableSpec("country", 20, 4)],
  ...     [FeatureSpec("clicks", "item", combiner="mean"),
  ...      FeatureSpec("last_item", "item", max_ids_per_sample=1),
  ...      FeatureSpec("history", "item", combiner=None),
  ...      FeatureSpec("country", "country")],
  ...     mesh=mesh, layout=CollectionLayout(num_unique=8, replicate_below_bytes=0),
  ...     rngs=nnx.Rngs(0))
  >>> out = coll({"clicks": jnp.array([[1, 2, -1], [3, -1, -1]]),
  ...             "last_item": jnp.array([5, 6]),
  ...             "history": jnp.array([[1, 1], [2, 7]]),
  ...             "country": jnp.array([0, 19])})
  >>> {k: v.shape for k, v in out.items()}
  {'clicks': (2, 16), 'last_item': (2, 16), 'history': (2, 2, 16), 'country': (2, 4)}
  >>> coll.plan["item"].plan.strategy  # each shard's 8 distinct ids to their owners
  'routed'
  >>> item = np.asarray(coll.tables["item"].logical_table())
  >>> bool(np.allclose(out["clicks"][0], (item[1] + item[2]) / 2))
  True

  Each table is a ``ShardedEmbed`` (``self.tables[name]``) laid out as
  ``self.plan`` says: same padding, invalid-id rule (zeros, no gradient) and
  ``nnx.Param`` as a lone ``ShardedEmbed``, so optimizers and checkpoints
  treat both alike. Pooled features use the pooled-bag kernel inside the
  table's strategy: only pooled rows are communicated, never
  ``[batch, bag, features]``.

  Dynamic tables (``TableSpec(..., dynamic=DynamicSpec(...))``) are
  ``embedlib.DynamicEmbed`` modules (``self.dynamic[name]``) read by raw
  ids: ``[batch]`` or padded ``[batch, bag]`` host integers of any dtype,
  32-bit device ids or ``embedlib.dynamic.Words``, pooled or as sequences
  (not ragged). All the features of one dynamic table are admitted together,
  as one step of its policy. They are laid out on their own (never stacked,
  no dedup); ``route_capacity`` applies to them, ``num_unique`` and
  ``node_capacity`` don't.

  Dedup (``num_unique``): each data shard looks up its distinct ids once
  (capacity ``num_unique`` per shard, for all features of a table together)
  and rebuilds its batch from the unique rows. When a shard holds more
  distinct ids than that, ``on_overflow="fallback"`` (default) takes the
  lookup without dedup through ``lax.cond`` (same result, more traffic), and
  ``on_overflow="error"`` raises a ``ValueError`` naming the table and the
  capacity it needs (eagerly for concrete ids; under ``jit`` through
  ``jax.experimental.checkify``). ``unique_counts`` measures the capacity a
  batch needs. By default (``num_unique="auto"``) the planner sets it for
  each routed table and stack whose expected distinct ids per shard
  (uniform over its rows) make the route move fewer bytes: a small table's
  few rows travel once instead of once per lookup; ``coll.num_unique`` holds
  what it chose.

  Args:
    tables: the ``TableSpec`` s.
    features: the ``FeatureSpec`` s; several may read one table.
    mesh: a ``Mesh`` or ``AbstractMesh``; None takes the one set with
      ``jax.set_mesh``, or one device.
    layout: an ``embedlib.CollectionLayout``: the mesh axes, dedup
      (``num_unique``), route and node capacities, ``on_overflow``, the
      batch and memory the planner sizes for, replication and stacking.
      None: its defaults. The keywords it replaces (``num_unique=``,
      ``table_batched=``, ...) still work until embedlib 0.2, with a
      ``DeprecationWarning``.
    dtype: dtype of the outputs (default: ``param_dtype``).
    param_dtype: dtype of the stored tables.
    rngs: random number generators; ``rngs.params()`` draws each table.
  """

  @_deprecated.moved_keywords(
      "EmbeddingCollection", {"layout": (CollectionLayout, "embedlib.CollectionLayout")})
  def __init__(
      self,
      tables: Sequence[TableSpec],
      features: Sequence[FeatureSpec],
      *,
      mesh=None,
      layout: CollectionLayout | None = None,
      dtype: tp.Any = None,
      param_dtype: tp.Any = jnp.float32,
      rngs: nnx.Rngs,
  ):
    layout = CollectionLayout() if layout is None else layout
    if not isinstance(layout, CollectionLayout):
      raise TypeError(f"EmbeddingCollection: layout={layout!r}; pass an "
                      "embedlib.CollectionLayout(...) or None.")
    (table_axes, data_axes, kernel, num_unique, route_capacity, on_overflow, batch_size,
     replicate_below_bytes, replicate_budget_bytes, table_batched, devices_per_host,
     device_memory_bytes, optimizer, devices_per_node, node_capacity) = (
         getattr(layout, f) for f in field_names(CollectionLayout))
    tables, features = validate(tables, features)
    all_tables, all_features = tables, features
    dynamic_specs = [t for t in tables if t.dynamic is not None]
    dynamic_names = {t.name for t in dynamic_specs}
    # Dynamic tables have a layout of their own (whole buckets): the planner lays out the rest.
    tables = tuple(t for t in tables if t.dynamic is None)
    features = tuple(f for f in features if f.table not in dynamic_names)
    dynamic_route = route_capacity
    num_unique, route_capacity, node_capacity = (
        {k: v for k, v in c.items() if k not in dynamic_names} if isinstance(c, Mapping) else c
        for c in (num_unique, route_capacity, node_capacity))
    kernels.resolve_kernel(kernel)  # fail early on an unknown kernel name
    if on_overflow not in OVERFLOW_MODES:
      raise ValueError(f"on_overflow={on_overflow!r}; use one of {OVERFLOW_MODES}.")
    mesh = sharding_lib.mesh_or_current(mesh)
    self.num_unique = _capacities(num_unique, tables)
    if on_overflow == ERROR:  # a capacity the caller never chose must not raise
      self.num_unique = {k: v for k, v in self.num_unique.items() if v != options.AUTO}
    self.route_capacity = _capacities(route_capacity, tables, "route_capacity",
                                      "ids per destination rank")
    node_capacities = _capacities(node_capacity, tables, "node_capacity",
                                  "distinct ids per destination rank from one node")
    if devices_per_host is None and mesh is not None and sharding_lib.has_devices(mesh):
      devices_per_host = _devices_per_host(mesh)
    self.plan = _empty_plan(mesh, batch_size) if not tables else planner.plan_collection(
        tables, features, mesh=mesh, table_axes=table_axes, data_axes=data_axes,
        param_dtype=param_dtype, batch_size=batch_size, num_unique=self.num_unique,
        route_capacity=self.route_capacity,
        replicate_below_bytes=replicate_below_bytes,
        replicate_budget_bytes=replicate_budget_bytes, table_batched=table_batched,
        devices_per_host=devices_per_host, device_memory_bytes=device_memory_bytes,
        devices_per_node=devices_per_node, node_capacity=node_capacities,
        optimizer=optimizer,
    )
    for what, given in (("num_unique", num_unique), ("route_capacity", route_capacity),
                        ("node_capacity", node_capacity)):
      _check_stacked_keys(what, given, self.plan)
    # "auto" resolved: the capacities the planner chose (None: no dedup).
    self.num_unique = {t.name: t.num_unique for t in [*self.plan.tables, *self.plan.stacks]
                       if getattr(t, "stack", None) is None and t.num_unique is not None}
    self.table_specs = all_tables
    self.feature_specs = all_features
    self.mesh = mesh
    self.kernel = kernel
    self.on_overflow = on_overflow
    self.dtype = dtype
    embeds = {}
    for spec, table_plan in zip(tables, self.plan.tables):
      if table_plan.stack is not None:
        continue
      p = table_plan.plan
      embeds[spec.name] = ShardedEmbed(
          spec.num_embeddings, spec.features, mesh=mesh, layout=Layout(
              sharding=p.strategy, table_axes=p.table_axes or None,
              column_axes=p.column_axes or None, data_axes=p.data_axes, kernel=kernel,
              ids_per_device=p.ids_per_device, route_capacity=p.route_capacity,
              devices_per_node=p.devices_per_node, node_capacity=p.node_capacity,
              on_overflow=on_overflow),
          name=spec.name, dtype=dtype, param_dtype=param_dtype,
          embedding_init=_fixed_init(spec), rngs=rngs,
      )
      assert embeds[spec.name].plan.padded_shape == p.padded_shape, spec.name
      assert embeds[spec.name].plan.node_route == p.node_route, spec.name
    self.tables = nnx.Dict(embeds)
    specs = {t.name: t for t in tables}
    stacks = {}
    for s in self.plan.stacks:
      p = s.plan
      stacks[s.name] = ShardedEmbed(
          p.num_embeddings, p.features, mesh=mesh, layout=Layout(
              sharding=p.strategy, table_axes=p.table_axes, data_axes=p.data_axes,
              kernel=kernel, ids_per_device=p.ids_per_device,
              route_capacity=p.route_capacity, devices_per_node=p.devices_per_node,
              node_capacity=p.node_capacity, on_overflow=on_overflow,
              placement=p.placement),
          name=s.name, dtype=dtype, param_dtype=param_dtype,
          embedding_init=_stacked_init([specs[m] for m in s.members]), rngs=rngs,
      )
    self.stacks = nnx.Dict(stacks)
    self.dynamic = nnx.Dict({
        t.name: _dynamic_table(t, dynamic_route, mesh, table_axes, data_axes, dtype,
                               param_dtype, rngs) for t in dynamic_specs})
    self.plan = dataclasses.replace(self.plan, dynamic=tuple(
        _dynamic_plan(t, optimizer) for t in self.dynamic.values()))

  def logical_table(self, name: str):
    """Table ``name``'s logical ``[num_embeddings, features]`` rows, wherever it lives."""
    if name in self.tables:
      return self.tables[name].logical_table()
    if name in self.dynamic:
      return self.dynamic[name].rows.logical_table()
    for s in self.plan.stacks:
      if name in s.members:
        return self._members(s, names=(name,))[name]
    raise KeyError(f"no table {name!r} in the collection; tables: "
                   f"{[t.name for t in self.table_specs]}.")

  def logical_tables(self) -> dict:
    """Every table's logical rows by name (each stack read once)."""
    out = {name: t.logical_table() for name, t in self.tables.items()}
    out.update({name: t.rows.logical_table() for name, t in self.dynamic.items()})
    for s in self.plan.stacks:
      out.update(self._members(s))
    return {t.name: out[t.name] for t in self.table_specs}

  def _members(self, stack, names=None):
    # Each member whole on every device (members are cut at uneven rows), the
    # stack never: it is moved to logical rows split over its devices first.
    module = self.stacks[stack.name]
    return table_lib.stack_members(module.physical_table(), module.plan, module.mesh, names)

  # -- lookups -----------------------------------------------------------

  def __call__(self, inputs: Mapping[str, tp.Any], weights: Mapping[str, tp.Any] | None = None):
    """Embeds every feature.

    Args:
      inputs: feature name -> ids: ``[batch]`` (single-hot), ``[batch, bag]``
        padded with -1, or a ``Ragged`` / ``(values, lengths)`` pair. Every
        feature of the collection must be present; all share the batch.
      weights: optional feature name -> float weights shaped like its ids
        (``[capacity]`` for ragged ids); pooled features only.

    Returns:
      feature name -> ``[batch, features]`` for pooled features (and
      single-hot sequence features), ``[batch, bag, features]`` for sequence
      features, in the order of the ``FeatureSpec`` s.
    """
    weights = dict(weights or {})
    bags = self._bags(inputs, weights)
    out, checks = {}, []
    for name, module, requests in self._lookups(bags, inputs, weights):
      rows = module.lookup_requests(
          [r for _, r in requests], num_unique=self.num_unique.get(name),
          on_overflow=self.on_overflow, checks=checks,
      )
      out.update(zip((f for f, _ in requests), rows))
    # After every table's lookups: under checkify a traced check can't precede
    # a later shard_map (another table's lookup).
    for check in checks:
      check()
    return {f.name: out[f.name] for f in self.feature_specs}

  def _lookups(self, bags, inputs=None, weights=None):
    """``(name, module, [(feature, Request)])`` per table: dynamic, its own, stacks.

    Dynamic tables read the raw ``inputs`` (left out without them); the
    others their features' ``bags``.
    """
    for name, module in self.dynamic.items() if inputs is not None else ():
      yield name, module, [
          (f.name, inputs_lib.raw_request(f, inputs[f.name], weights.get(f.name)))
          for f in self._features_of(name)]
    for spec in self.table_specs:
      if spec.name in self.tables:
        yield spec.name, self.tables[spec.name], [
            (f.name, _request(f, bags[f.name])) for f in self._features_of(spec.name)]
    for s in self.plan.stacks:
      placement = s.plan.placement
      requests = []
      for member in s.members:
        start = placement.start(member)
        for f in self._features_of(member):
          r = _request(f, bags[f.name])
          # The member's rows follow the earlier members' in the stack.
          ids = jnp.where(r.ids >= 0, r.ids + start, -1)
          requests.append((f.name, r.replace(ids=ids, member=member)))
      yield s.name, self.stacks[s.name], requests

  def unique_counts(self, inputs: Mapping[str, tp.Any]) -> dict[str, int]:
    """The dedup capacity each table needs for ``inputs``: distinct ids per shard.

    Dynamic tables are left out: they don't dedup.

    >>> from flax import nnx
    >>> coll = EmbeddingCollection([TableSpec("t", 10, 4)],
    ...                            [FeatureSpec("a", "t"), FeatureSpec("b", "t")],
    ...                            rngs=nnx.Rngs(0))
    >>> coll.unique_counts({"a": jnp.array([[1, 2], [2, -1]]), "b": jnp.array([[9], [1]])})
    {'t': 3}
    """
    bags = self._bags(inputs, {})
    return {
        name: module.distinct_ids_per_shard([r for _, r in requests])
        for name, module, requests in self._lookups(bags)
    }

  def _features_of(self, table: str) -> list[FeatureSpec]:
    return [f for f in self.feature_specs if f.table == table]

  def _bags(self, inputs, weights):
    names = tuple(f.name for f in self.feature_specs)
    for what, given in (("inputs", inputs), ("weights", weights)):
      unknown = [k for k in given if k not in names]
      if unknown:
        raise ValueError(
            f"{what} name feature {unknown[0]!r}, which the collection doesn't "
            f"have; its features are {names}."
        )
    missing = [n for n in names if n not in inputs]
    if missing:
      raise ValueError(
          f"feature {missing[0]!r} has no ids in the inputs ({len(missing)} "
          f"missing); pass ids for every feature of {names}."
      )
    rows = {t.name: t.num_embeddings for t in self.table_specs if t.dynamic is None}
    bags = {
        f.name: inputs_lib.to_bags(f, inputs[f.name], weights.get(f.name), rows[f.table])
        for f in self.feature_specs if f.table in rows
    }
    if not bags:
      return bags
    first = next(iter(bags))
    for name, b in bags.items():
      if b.batch != bags[first].batch:
        raise ValueError(
            f"feature {name!r} has batch {b.batch} but feature {first!r} has "
            f"{bags[first].batch}; every feature of one call shares the batch."
        )
    return bags

def _request(spec: FeatureSpec, bags: inputs_lib.Bags) -> Request:
  """A feature's lookup: pooled bags, or rows (single-hot rows as ``[batch]``)."""
  if spec.is_sequence:
    # squeeze, not [:, 0]: JAX fails an eager empty gather on an Explicit mesh.
    return Request(jnp.squeeze(bags.ids, 1) if bags.single_hot else bags.ids)
  return Request(bags.ids, bags.weights, spec.combiner)


def _dynamic_table(spec, route_capacity, mesh, table_axes, data_axes, dtype, param_dtype,
                   rngs):
  """The ``DynamicEmbed`` of a dynamic ``TableSpec``."""
  if spec.dynamic.route_capacity is None and isinstance(route_capacity, Mapping):
    route_capacity = route_capacity.get(spec.name)
  elif spec.dynamic.route_capacity is not None:
    route_capacity = None  # the spec's own, which the table reads from it
  # A TableSpec without an initializer leaves DynamicEmbed's own default.
  init = {} if spec.initializer is None else {"embedding_init": spec.initializer}
  return dynamic_module.DynamicEmbed(
      spec.num_embeddings, spec.features, dynamic=spec.dynamic, mesh=mesh,
      layout=Layout(sharding=spec.sharding, table_axes=table_axes, data_axes=data_axes,
                    route_capacity=route_capacity),
      name=spec.name, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **init)


def _dynamic_plan(table, optimizer) -> planner.DynamicTablePlan:
  """A ``DynamicEmbed``'s line of the collection's plan: its layout and bytes a device."""
  p, policy = table.rows.plan, table.policy
  default = 0 if table.default_row is None else table.features * p.itemsize
  return planner.DynamicTablePlan(
      name=table.name, capacity=policy.capacity, features=table.features, strategy=p.strategy,
      group=table.group, bucket_size=policy.bucket_size, admit_after=policy.admit_after,
      eviction=policy.eviction, rows=p.bytes_per_device + default,
      slots=plan_memory.slot_bytes(p, optimizer), map=table.map_bytes_per_device())


def _empty_plan(mesh, batch_size):
  """The plan of a collection whose tables are all dynamic."""
  shape = () if mesh is None else tuple(dict(mesh.shape).items())
  return planner.CollectionPlan((), batch_size, shape)


def _check_stacked_keys(what, given, plan):
  """A capacity keyed by a table that lives in a stack belongs to the stack."""
  if not isinstance(given, Mapping):
    return
  for s in plan.stacks:
    for name in given:
      if name in s.members:
        raise ValueError(
            f"{what} names table {name!r}, which lives in stack {s.name!r} with "
            f"{', '.join(repr(m) for m in s.members)}: one route serves them all; pass "
            f"{what}={{{s.name!r}: N}} instead."
        )


def _stacked_init(specs):
  """The initializer of a stack: each member's own, one after the other."""

  def init(key, shape, dtype):
    keys = jax.random.split(key, len(specs))
    return jnp.concatenate(
        [_fixed_init(s)(k, (s.num_embeddings, shape[1]), dtype) for k, s in zip(keys, specs)])

  return init


def _fixed_init(spec):
  """A fixed table's initializer: the spec's, or ``nnx.Embed``'s default."""
  return default_embed_init if spec.initializer is None else spec.initializer


def _devices_per_host(mesh) -> int | None:
  """Devices of one process in the mesh's device order (None when hosts interleave)."""
  procs = [d.process_index for d in mesh.devices.reshape(-1)]
  per_host = procs.count(procs[0])
  blocks = [procs[i:i + per_host] for i in range(0, len(procs), per_host)]
  return per_host if all(len(set(b)) == 1 for b in blocks) else None


def _capacities(capacity, tables, what="num_unique",
                unit="unique ids per data shard") -> dict[str, int]:
  """``{table or stack: capacity}`` from an int for every one, a dict, or None."""
  names = [t.name for t in tables]
  names += sorted({stacks_lib.stack_name(t.features) for t in tables} - set(names))
  if capacity is None:
    return {}
  if not isinstance(capacity, Mapping):
    capacity = {n: capacity for n in names}
  out = {}
  for name, cap in capacity.items():
    if name not in names:
      raise ValueError(
          f"{what} names table {name!r}, which is not in the collection "
          f"(tables: {tuple(names)})."
      )
    if what == "num_unique" and cap == options.AUTO:
      out[name] = cap
      continue
    if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1:
      raise ValueError(
          f"table {name!r}: {what} must be an int >= 1 ({unit}), got {cap!r}."
      )
    out[name] = int(cap)
  return out
