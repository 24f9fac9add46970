"""``EmbeddingCollection``: many features over many sharded tables, in one module."""

from __future__ import annotations

import typing as tp
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from embedlib import kernels
from embedlib import sharding as sharding_lib
from embedlib.collection import inputs as inputs_lib
from embedlib.collection import planner
from embedlib.collection.specs import FeatureSpec, TableSpec, validate
from embedlib.embed import ShardedEmbed
from embedlib.strategies import Request
from embedlib.strategies.dedup import ERROR, FALLBACK, OVERFLOW_MODES


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
  ``jax.experimental.checkify``). ``unique_counts`` measures the capacity a
  batch needs.

  Args:
    tables: the ``TableSpec`` s.
    features: the ``FeatureSpec`` s; several may read one table.
    mesh: a ``Mesh`` or ``AbstractMesh``; None takes the one set with
      ``jax.set_mesh``, or one device.
    table_axes: mesh axes tables are split over (see ``plan_embedding``).
    data_axes: mesh axes the batch is split over.
    kernel: local lookup kernel, one of ``options.KERNELS`` (see
      ``ShardedEmbed``).
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
    mesh = sharding_lib.current_mesh() if mesh is None else mesh
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
          name=spec.name, dtype=dtype, param_dtype=param_dtype,
          embedding_init=spec.initializer, rngs=rngs,
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
    out, checks = {}, []
    for spec in self.table_specs:
      feats = self._features_of(spec.name)
      rows = self.tables[spec.name].lookup_requests(
          [_request(f, bags[f.name]) for f in feats],
          num_unique=self.num_unique.get(spec.name), on_overflow=self.on_overflow,
          checks=checks,
      )
      out.update(zip((f.name for f in feats), rows))
    # After every table's lookups: under checkify a traced check can't precede
    # a later shard_map (another table's lookup).
    for check in checks:
      check()
    return {f.name: out[f.name] for f in self.feature_specs}

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
    return {
        spec.name: self.tables[spec.name].distinct_ids_per_shard(
            [_request(f, bags[f.name]) for f in self._features_of(spec.name)]
        )
        for spec in self.table_specs
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

def _request(spec: FeatureSpec, bags: inputs_lib.Bags) -> Request:
  """A feature's lookup: pooled bags, or rows (single-hot rows as ``[batch]``)."""
  if spec.is_sequence:
    # squeeze, not [:, 0]: JAX fails an eager empty gather on an Explicit mesh.
    return Request(jnp.squeeze(bags.ids, 1) if bags.single_hot else bags.ids)
  return Request(bags.ids, bags.weights, spec.combiner)


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
