"""``EmbeddingCollection``: many features over many sharded tables, in one module."""

from __future__ import annotations

import functools
import typing as tp
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.experimental import checkify

from embedlib import _compat
from embedlib import kernels
from embedlib import strategies
from embedlib.collection import dedup
from embedlib.collection import inputs as inputs_lib
from embedlib.collection import planner
from embedlib.collection.specs import FeatureSpec, TableSpec, validate
from embedlib import embed as embed_lib
from embedlib.embed import ShardedEmbed

FALLBACK = "fallback"
ERROR = "error"
OVERFLOW_MODES = (FALLBACK, ERROR)


class EmbeddingCollection(nnx.Module):
  """Embeds a dict of categorical features, each table sharded by its own plan.

  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from flax import nnx
  >>> from embedlib import EmbeddingCollection, FeatureSpec, TableSpec
  >>> mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
  >>> coll = EmbeddingCollection(
  ...     [TableSpec("item", 1000, 16), TableSpec("country", 20, 4)],
  ...     [FeatureSpec("clicks", "item", combiner="mean"),
  ...      FeatureSpec("last_item", "item", max_ids_per_sample=1),
  ...      FeatureSpec("history", "item", combiner=None),
  ...      FeatureSpec("country", "country")],
  ...     mesh=mesh, num_unique=8, replicate_below_bytes=0, rngs=nnx.Rngs(0))
  >>> out = coll({"clicks": jnp.array([[1, 2, -1], [3, -1, -1]]),
  ...             "last_item": jnp.array([5, 6]),
  ...             "history": jnp.array([[1, 1], [2, 7]]),
  ...             "country": jnp.array([0, 19])})
  >>> {k: v.shape for k, v in out.items()}
  {'clicks': (2, 16), 'last_item': (2, 16), 'history': (2, 2, 16), 'country': (2, 4)}
  >>> coll.plan["item"].plan.strategy
  'vocab'
  >>> item = np.asarray(coll.tables["item"].logical_table())
  >>> bool(np.allclose(out["clicks"][0], (item[1] + item[2]) / 2))
  True

  Each table is a ``ShardedEmbed`` (``self.tables[name]``) laid out as
  ``self.plan`` says: same padding, invalid-id rule (zeros, no gradient) and
  ``nnx.Param`` as a lone ``ShardedEmbed``, so optimizers and checkpoints
  treat both alike. Pooled features use the pooled-bag kernel inside the
  table's strategy: only pooled rows are communicated, never
  ``[batch, bag, features]``.

  Dedup (``num_unique``): each data shard looks up its distinct ids once
  (capacity ``num_unique`` per shard, for all features of a table together)
  and rebuilds its batch from the unique rows. When a shard holds more
  distinct ids than that, ``on_overflow="fallback"`` (default) takes the
  lookup without dedup through ``lax.cond`` (same result, more traffic), and
  ``on_overflow="error"`` raises a ``ValueError`` naming the table and the
  capacity it needs (eagerly for concrete ids; under ``jit`` through
  ``jax.experimental.checkify``; the check comes after all of the call's
  lookups because, on jax 0.10, a ``checkify.check`` followed by a
  ``shard_map`` in the same jit fails to trace). ``unique_counts`` measures
  the capacity a batch needs.

  Args:
    tables: the ``TableSpec`` s.
    features: the ``FeatureSpec`` s; several may read one table.
    mesh: a ``Mesh`` or ``AbstractMesh``; None takes the one set with
      ``jax.set_mesh``, or one device.
    table_axes: mesh axes tables are split over (see ``plan_embedding``).
    data_axes: mesh axes the batch is split over.
    kernel: local lookup kernel, ``"auto" | "xla" | "pallas" | "cpu"``
      (``kernels.resolve_kernel``).
    num_unique: dedup capacity per data shard: an int for every table, a
      ``{table: capacity}`` dict, or None (no dedup).
    on_overflow: ``"fallback" | "error"`` (see above).
    batch_size: samples per step, for the plan's traffic estimates only.
    replicate_below_bytes: the per-table auto rule's replication threshold.
    replicate_budget_bytes: replicate tables together up to this many bytes
      per device (see ``plan_collection``).
    dtype: dtype of the outputs (default: ``param_dtype``).
    param_dtype: dtype of the stored tables.
    rngs: random number generators; ``rngs.params()`` draws each table.
  """

  def __init__(
      self,
      tables: Sequence[TableSpec],
      features: Sequence[FeatureSpec],
      *,
      mesh=None,
      table_axes=None,
      data_axes=None,
      kernel: str = "auto",
      num_unique: int | Mapping[str, int] | None = None,
      on_overflow: str = FALLBACK,
      batch_size: int = 4096,
      replicate_below_bytes: int | None = None,
      replicate_budget_bytes: int | None = None,
      dtype: tp.Any = None,
      param_dtype: tp.Any = jnp.float32,
      rngs: nnx.Rngs,
  ):
    tables, features = validate(tables, features)
    kernels.resolve_kernel(kernel)  # fail early on an unknown kernel name
    if on_overflow not in OVERFLOW_MODES:
      raise ValueError(f"on_overflow={on_overflow!r}; use one of {OVERFLOW_MODES}.")
    mesh = _compat.current_mesh() if mesh is None else mesh
    self.num_unique = _capacities(num_unique, tables)
    self.plan = planner.plan_collection(
        tables, features, mesh=mesh, table_axes=table_axes, data_axes=data_axes,
        param_dtype=param_dtype, batch_size=batch_size, num_unique=self.num_unique,
        replicate_below_bytes=replicate_below_bytes,
        replicate_budget_bytes=replicate_budget_bytes,
    )
    self.table_specs = tables
    self.feature_specs = features
    self.mesh = mesh
    self.kernel = kernel
    self.on_overflow = on_overflow
    self.dtype = dtype
    embeds = {}
    for spec, table_plan in zip(tables, self.plan.tables):
      p = table_plan.plan
      embeds[spec.name] = ShardedEmbed(
          spec.num_embeddings, spec.features, mesh=mesh, sharding=p.strategy,
          table_axes=p.table_axes or None, data_axes=p.data_axes, kernel=kernel,
          name=spec.name, param_dtype=param_dtype, embedding_init=spec.initializer,
          rngs=rngs,
      )
      assert embeds[spec.name].plan.padded_shape == p.padded_shape, spec.name
    self.tables = nnx.Dict(embeds)

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
    bags = self._bags(inputs, dict(weights or {}))
    if embed_lib.eager_on_mesh(
        self.mesh, [(b.ids, b.weights) for b in bags.values()],
        [t.embedding[...] for t in self.tables.values()]):
      # One cached jit instead of op-by-op dispatch, which compiles every
      # shard_map and placement afresh on each call (15 s per call for the
      # 8 tables of configs/quickstart.py on the 8-device CPU mesh, 10 to 20
      # ms jitted).
      out, needs = _jitted_lookups(
          self, {n: (b.ids, b.weights) for n, b in bags.items()},
          tuple((n, b.single_hot) for n, b in bags.items()),
      )
      for name, need in needs.items():
        _check_capacity(need, self.num_unique[name], name)
      return {f.name: out[f.name] for f in self.feature_specs}  # jit sorts keys
    out, checks = self._lookups(bags)
    # After every lookup: on jax 0.10 a checkify.check followed by a
    # shard_map in the same jit fails to trace.
    for need, capacity, name in checks:
      _check_capacity(need, capacity, name)
    return out

  def _lookups(self, bags):
    """Every feature's rows, and the dedup capacity checks still to run."""
    out, checks = {}, []
    for spec in self.table_specs:
      feats = [f for f in self.feature_specs if f.table == spec.name]
      embed = self.tables[spec.name]
      table = embed.embedding[...]
      if spec.name in self.num_unique:
        rows = self._lookup_dedup(embed, table, feats, bags, checks)
      else:
        rows = self._lookup(embed, table, feats, bags)
      if _row_tap() is not None:
        rows = self._tap(embed, feats, bags, rows)
      out.update(zip((f.name for f in feats), rows))
    out = {
        f.name: out[f.name] if self.dtype is None else out[f.name].astype(self.dtype)
        for f in self.feature_specs
    }
    return out, checks

  def unique_counts(self, inputs: Mapping[str, tp.Any]) -> dict[str, int]:
    """The dedup capacity each table needs for ``inputs``: distinct ids per shard.

    >>> from flax import nnx
    >>> coll = EmbeddingCollection([TableSpec("t", 10, 4)],
    ...                            [FeatureSpec("a", "t"), FeatureSpec("b", "t")],
    ...                            rngs=nnx.Rngs(0))
    >>> coll.unique_counts({"a": jnp.array([[1, 2], [2, -1]]), "b": jnp.array([[9], [1]])})
    {'t': 3}
    """
    bags = self._bags(inputs, {})
    counts = {}
    for spec in self.table_specs:
      plan = self.tables[spec.name].plan
      feats = [f for f in self.feature_specs if f.table == spec.name]
      ids = _concat_ids(plan, feats, bags)
      counts[spec.name] = int(_max_unique(ids, plan=plan, mesh=self.mesh))
    return counts

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
    rows = {t.name: t.num_embeddings for t in self.table_specs}
    bags = {
        f.name: inputs_lib.to_bags(f, inputs[f.name], weights.get(f.name), rows[f.table])
        for f in self.feature_specs
    }
    first = self.feature_specs[0].name
    for name, b in bags.items():
      if b.batch != bags[first].batch:
        raise ValueError(
            f"feature {name!r} has batch {b.batch} but feature {first!r} has "
            f"{bags[first].batch}; every feature of one call shares the batch."
        )
    return bags

  def _tap(self, embed, feats, bags, rows):
    """Reports each feature's lookup to ``embedlib.optim`` (see ``embed.ROW_TAPS``).

    Outside the dedup ``lax.cond``: a tap records traced ids, which must not
    leak out of a branch. Per feature, whatever the path: pooled outputs with
    each id's coefficient in its bag, sequence outputs row by row.
    """
    tap, out = _row_tap(), []
    for f, r in zip(feats, rows):
      b = bags[f.name]
      if f.is_sequence:
        out.append(tap.lookup(embed, b.ids[:, 0] if b.single_hot else b.ids, r))
      else:
        coef = kernels.bag_coefficients(b.ids, b.weights, embed.num_embeddings, f.combiner)
        out.append(tap.lookup(embed, b.ids, r, coef))
    return tuple(out)

  def _kernels(self):
    return (
        functools.partial(kernels.gather, kernel=self.kernel),
        functools.partial(kernels.bag, kernel=self.kernel),
        # False only for the Pallas interpreter (see kernels.shard_map_check_vma).
        kernels.shard_map_check_vma(self.kernel),
    )

  def _lookup(self, embed, table, feats, bags):
    """One lookup per feature, no dedup."""
    gather, bag, check_vma = self._kernels()
    out = []
    for f in feats:
      b = bags[f.name]
      if f.is_sequence:
        ids = b.ids[:, 0] if b.single_hot else b.ids
        out.append(strategies.lookup(
            table, ids, plan=embed.plan, mesh=self.mesh, gather=gather, check_vma=check_vma
        ))
      else:
        out.append(strategies.lookup_bag(
            table, b.ids, b.weights, plan=embed.plan, mesh=self.mesh, bag=bag,
            combiner=f.combiner, check_vma=check_vma,
        ))
    return tuple(out)

  def _lookup_dedup(self, embed, table, feats, bags, checks):
    """One lookup of each shard's unique ids, shared by the table's features."""
    plan, name, mesh = embed.plan, embed.plan.name, self.mesh
    capacity = self.num_unique[name]
    gather, bag, check_vma = self._kernels()
    batch = bags[feats[0].name].batch
    unique, inverse, counts = dedup.unique_per_shard(
        _concat_ids(plan, feats, bags), capacity, plan=plan, mesh=mesh
    )
    need = jnp.max(counts)
    coefs = tuple(
        None if f.is_sequence else dedup.pad_batch(
            kernels.bag_coefficients(
                bags[f.name].ids, bags[f.name].weights, plan.num_embeddings, f.combiner
            ),
            plan.data_shards, 0,
        )
        for f in feats
    )

    def with_dedup(table, unique, inverse, coefs):
      rows = strategies.lookup(
          table, unique, plan=plan, mesh=mesh, gather=gather, check_vma=check_vma
      )
      cuts = np.cumsum([bags[f.name].ids.shape[1] for f in feats])[:-1]
      parts = jnp.split(inverse, cuts, axis=1)
      parts = [
          p[:, 0] if f.is_sequence and bags[f.name].single_hot else p
          for p, f in zip(parts, feats)
      ]
      out = dedup.rebuild(
          rows, parts, coefs, plan=plan, mesh=mesh, gather=gather, bag=bag,
          check_vma=check_vma,
      )
      return tuple(
          dedup.restore_batch(o, batch, mesh, bags[f.name].ids) for o, f in zip(out, feats)
      )

    def without_dedup(table, unique, inverse, coefs):
      del unique, inverse, coefs
      return self._lookup(embed, table, feats, bags)

    if self.on_overflow == ERROR:
      if isinstance(need, jax.core.Tracer):
        checks.append((need, capacity, name))  # checked after every lookup
      else:
        _check_capacity(need, capacity, name)  # eager: fail before the lookup
      return with_dedup(table, unique, inverse, coefs)
    return lax.cond(need > capacity, without_dedup, with_dedup, table, unique, inverse, coefs)


@functools.partial(nnx.jit, static_argnums=2)
def _jitted_lookups(coll, arrays, single_hot):
  """``coll``'s lookups of padded bags; returns ``(rows, {table: distinct ids needed})``.

  ``single_hot``: ``(feature, bool)`` pairs, static; ``arrays``: feature ->
  ``(ids, weights)``.
  """
  bags = {n: inputs_lib.Bags(*arrays[n], single) for n, single in single_hot}
  out, checks = coll._lookups(bags)
  return out, {name: need for need, _, name in checks}


@functools.partial(jax.jit, static_argnames=("plan", "mesh"))
def _max_unique(ids, *, plan, mesh):
  # Jitted: an eager shard_map runs op by op, far slower than one compile.
  capacity = ids.size // plan.data_shards  # can't overflow
  _, _, counts = dedup.unique_per_shard(ids, capacity, plan=plan, mesh=mesh)
  return jnp.max(counts)


def _row_tap():
  """The innermost active row tap of ``embedlib.optim``, or None."""
  taps = getattr(embed_lib, "ROW_TAPS", ())
  return taps[-1] if taps else None


def _concat_ids(plan, feats, bags):
  """The bags of all ``feats`` side by side, batch padded to the data shards."""
  ids = jnp.concatenate([bags[f.name].ids for f in feats], axis=1)
  return dedup.pad_batch(ids, plan.data_shards, -1)


def _check_capacity(need, capacity: int, name: str) -> None:
  or_fallback = "or on_overflow='fallback' to look such batches up without dedup"
  if isinstance(need, jax.core.Tracer):
    checkify.check(
        need <= capacity,
        f"table {name!r}: a data shard holds {{need}} distinct ids, more than "
        f"num_unique={capacity}; pass num_unique={{{{{name!r}: N}}}} with N at "
        f"least that count, {or_fallback}.",
        need=need,
    )
    return
  if int(need) > capacity:
    raise ValueError(
        f"table {name!r}: a data shard holds {int(need)} distinct ids, more "
        f"than num_unique={capacity}; pass num_unique={{{name!r}: {int(need)}}} "
        f"(or more), {or_fallback}."
    )


def _capacities(num_unique, tables) -> dict[str, int]:
  names = [t.name for t in tables]
  if num_unique is None:
    return {}
  if not isinstance(num_unique, Mapping):
    num_unique = {n: num_unique for n in names}
  out = {}
  for name, cap in num_unique.items():
    if name not in names:
      raise ValueError(
          f"num_unique names table {name!r}, which is not in the collection "
          f"(tables: {tuple(names)})."
      )
    if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1:
      raise ValueError(
          f"table {name!r}: num_unique must be an int >= 1 (unique ids per data "
          f"shard), got {cap!r}."
      )
    out[name] = int(cap)
  return out
