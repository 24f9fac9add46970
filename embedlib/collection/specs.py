"""``TableSpec`` and ``FeatureSpec``: what a collection holds, validated up front.

Frozen dataclasses in the manner of keras-rs ``TableConfig`` /
``FeatureConfig``: a table is a vocabulary and a width; a feature is a named
input that reads one table and says how its ids are combined. Several
features may read one table. Every check runs on construction, and every
message names the table or feature and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import typing as tp
from collections.abc import Sequence

import jax
import numpy as np

from embedlib import options
from embedlib.plan import checks
from embedlib.dynamic.spec import DynamicSpec

#: ``FeatureSpec.combiner`` for a sequence feature: rows are returned, not pooled.
SEQUENCE = None


def _positive_int(value, what: str, owner: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{owner}: {what} must be an int, got {value!r}.")
  if value < 1:
    raise ValueError(f"{owner}: {what} must be >= 1, got {value}.")
  return int(value)


def _name(value, kind: str) -> str:
  if not isinstance(value, str) or not value:
    raise ValueError(f"{kind} name must be a non-empty str, got {value!r}.")
  return value


@dataclasses.dataclass(frozen=True)
class TableSpec:
  """One embedding table of a collection.

  >>> TableSpec("user", 1000, 16).sharding
  'auto'
  >>> TableSpec("user", 0, 16)
  Traceback (most recent call last):
  ...
  ValueError: table 'user': num_embeddings must be >= 1, got 0.

  Attributes:
    name: unique table name (the key of the table in the collection).
    num_embeddings: vocabulary size; ids lie in ``[0, num_embeddings)``.
    features: embedding width.
    initializer: ``init(key, shape, dtype)`` for the logical table; None:
      ``nnx.Embed``'s default, or ``DynamicEmbed``'s for a dynamic table
      (``embedlib.dynamic.HashedUniform``).
    sharding: ``"auto" | "replicated" | "vocab" | "hidden" | "routed" |
      "grid"``, or a placement in a stack of tables of its width:
      ``"table"`` (whole on one device) or ``"table_row"`` (split over one
      host's devices); ``auto`` lets the collection's planner choose. A
      grid table splits its rows over the collection's ``table_axes`` and
      its columns over ``column_axes``, and is never stacked.
    device: for ``"table"``, the device (rank in the table group) to put it
      on; None lets the planner balance the devices.
    host: for ``"table_row"``, the host whose devices hold it; None lets
      the planner choose.
    column_axes: for ``"grid"``, the mesh axes its columns are split over
      (a name or a tuple of names); None: the data axes that are not table
      axes.
    id_skew: how much the table's ids repeat, for the planner's estimate of
      a batch's distinct ids (dedup's capacity, and whether dedup pays):
      the exponent of a Zipf law over the rows (``cost.distinct_ids``). 0,
      the default, plans for uniform ids, which repeat least; Criteo's
      categoricals are near 1. ``embedlib.collection.fit_id_skews`` fits
      it from a batch of real ids.
  """

  name: str
  num_embeddings: int
  features: int
  initializer: tp.Callable | None = None
  sharding: str = options.AUTO
  device: int | None = None
  host: int | None = None
  column_axes: str | tuple[str, ...] | None = None
  dynamic: DynamicSpec | None = None
  id_skew: float = 0.0

  def __post_init__(self):
    _name(self.name, "TableSpec")
    owner = f"table {self.name!r}"
    object.__setattr__(
        self, "num_embeddings", _positive_int(self.num_embeddings, "num_embeddings", owner)
    )
    object.__setattr__(self, "features", _positive_int(self.features, "features", owner))
    if self.initializer is not None and not callable(self.initializer):
      raise TypeError(
          f"{owner}: initializer must be callable as init(key, shape, dtype), "
          f"got {self.initializer!r}; e.g. jax.nn.initializers.normal(0.01)."
      )
    choices = (options.AUTO,) + options.STRATEGIES + options.PLACEMENTS
    if self.sharding not in choices:
      raise ValueError(f"{owner}: sharding={self.sharding!r}; use one of {choices}.")
    for field, kind in (("device", options.TABLE_WISE), ("host", options.TABLE_ROW_WISE)):
      value = getattr(self, field)
      if value is None:
        continue
      if self.sharding != kind:
        raise ValueError(
            f"{owner}: {field}={value} pins a {kind!r} placement, but sharding="
            f"{self.sharding!r}; pass sharding={kind!r} with it, or drop {field}."
        )
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{owner}: {field} must be an int >= 0, got {value!r}.")
    self._check_column_axes(owner)
    self._check_dynamic(owner)
    object.__setattr__(self, "id_skew", checks.check_skew(self.id_skew, owner))

  def _check_dynamic(self, owner: str) -> None:
    """A dynamic table's policy and layout, checked as ``DynamicEmbed`` checks them.

    >>> TableSpec("user", 256, 8, dynamic=DynamicSpec(admit_after=2)).dynamic.eviction
    'lru'
    """
    if self.dynamic is None:
      return
    if not isinstance(self.dynamic, DynamicSpec):
      raise TypeError(f"{owner}: dynamic must be a DynamicSpec(...) or None, got "
                      f"{self.dynamic!r}.")
    layouts = (options.AUTO, "replicated", "vocab", "routed")
    if self.sharding not in layouts:
      raise ValueError(
          f"{owner}: sharding={self.sharding!r}, but a dynamic table splits its rows in "
          f"whole buckets and is never stacked; use one of {layouts}.")
    self.dynamic.policy(self.num_embeddings, name=owner)  # its own checks, naming the table

  def _check_column_axes(self, owner: str) -> None:
    """``column_axes`` as a tuple of names, given only with a grid."""
    if self.column_axes is None:
      return
    if self.sharding != options.GRID:
      raise ValueError(
          f"{owner}: column_axes={self.column_axes!r} splits the columns as well as "
          f"the rows, which only sharding='grid' does (got sharding={self.sharding!r}; "
          f"a grid table is never stacked); pass sharding='grid', or drop column_axes."
      )
    axes = (self.column_axes,) if isinstance(self.column_axes, str) else self.column_axes
    try:
      axes = tuple(axes)
    except TypeError:
      axes = None
    if not axes or not all(isinstance(a, str) and a for a in axes):
      raise ValueError(
          f"{owner}: column_axes={self.column_axes!r}; pass a mesh axis name or a "
          f"tuple of them, e.g. column_axes=('fsdp',)."
      )
    object.__setattr__(self, "column_axes", axes)


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """One input feature: a name, the table it reads and how its ids combine.

  >>> FeatureSpec("clicked_items", "item", combiner="mean").is_sequence
  False
  >>> FeatureSpec("history", "item", combiner=None).is_sequence
  True

  Attributes:
    name: unique feature name (the key of its ids and of its output).
    table: name of the ``TableSpec`` it reads.
    combiner: ``"sum" | "mean" | "sqrtn"`` pools a bag into
      ``[batch, features]`` (TensorFlow semantics: mean divides by the bag's
      total weight, sqrtn by the root of its sum of squared weights; an
      empty bag pools to zeros); ``None`` makes a sequence feature that
      returns ``[batch, bag, features]``.
    max_ids_per_sample: the most ids one sample holds: ``1`` for a
      single-hot feature (``[batch]`` ids; a wider bag is an error), the bag
      capacity of a ragged input; ``None`` accepts padded bags of any width.
  """

  name: str
  table: str
  combiner: str | None = "sum"
  max_ids_per_sample: int | None = None

  def __post_init__(self):
    _name(self.name, "FeatureSpec")
    owner = f"feature {self.name!r}"
    if not isinstance(self.table, str) or not self.table:
      raise ValueError(
          f"{owner}: table must be the name of a TableSpec, got {self.table!r}."
      )
    if self.combiner is not SEQUENCE and self.combiner not in options.COMBINERS:
      raise ValueError(
          f"{owner}: combiner={self.combiner!r}; use one of {options.COMBINERS}, "
          f"or None for a sequence feature."
      )
    if self.max_ids_per_sample is not None:
      object.__setattr__(
          self,
          "max_ids_per_sample",
          _positive_int(self.max_ids_per_sample, "max_ids_per_sample", owner),
      )

  @property
  def is_sequence(self) -> bool:
    return self.combiner is SEQUENCE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Ragged:
  """A ragged batch of bags: ids back to back plus the length of each bag.

  The capacity is static (``values.shape[0]``); the bag width of the padded
  form is the feature's ``max_ids_per_sample``. A ``(values, lengths)``
  tuple is accepted wherever a ``Ragged`` is.

  >>> import jax.numpy as jnp
  >>> Ragged(jnp.array([4, 5, 6]), jnp.array([2, 1])).lengths.tolist()
  [2, 1]

  Attributes:
    values: int ``[capacity]``, the ids of all bags in order.
    lengths: int ``[batch]``, ids per bag; they sum to at most the capacity.
  """

  values: jax.Array
  lengths: jax.Array


def validate(tables: Sequence[TableSpec], features: Sequence[FeatureSpec]):
  """Checks a collection's specs together; returns them as tuples.

  >>> validate([TableSpec("t", 10, 4)], [FeatureSpec("f", "u")])
  Traceback (most recent call last):
  ...
  ValueError: feature 'f' reads table 'u', which is not in the collection (tables: ('t',)); add TableSpec('u', ...) or point the feature at one of those.
  """
  tables, features = tuple(tables), tuple(features)
  for kind, items, cls in (("table", tables, TableSpec), ("feature", features, FeatureSpec)):
    if not items:
      raise ValueError(f"an EmbeddingCollection needs at least one {kind}.")
    for item in items:
      if not isinstance(item, cls):
        raise TypeError(f"{kind}s must be {cls.__name__} objects, got {item!r}.")
    names = [i.name for i in items]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
      raise ValueError(
          f"{kind} name {dupes[0]!r} is used {names.count(dupes[0])} times; "
          f"give each {kind} a unique name."
      )
  known = tuple(t.name for t in tables)
  for f in features:
    if f.table not in known:
      raise ValueError(
          f"feature {f.name!r} reads table {f.table!r}, which is not in the "
          f"collection (tables: {known}); add TableSpec({f.table!r}, ...) or "
          f"point the feature at one of those."
      )
  unread = [t.name for t in tables if not any(f.table == t.name for f in features)]
  if unread:
    raise ValueError(
        f"table {unread[0]!r} is read by no feature; remove it or add a "
        f"FeatureSpec(..., table={unread[0]!r})."
    )
  return tables, features
