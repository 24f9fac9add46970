"""``plan_embedding``: how one table is laid out on a mesh, and why.

Pure Python, no arrays: the plan is a frozen record of the strategy, the mesh
axes it uses, the logical and padded shapes, the per-device bytes and the
estimated bytes a lookup moves, plus a sentence saying why. ``ShardedEmbed``
and the collection build their parameters and shard_map specs from it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from embedlib import options
from embedlib.plan import cost
from embedlib.plan import mesh_axes

#: Tables at most this big (bytes) are replicated by ``sharding="auto"``.
REPLICATE_BELOW_BYTES = 1 << 20
#: Below this many columns per rank a hidden split is too narrow to pay off.
MIN_SHARD_WIDTH = 8
#: Hidden sharding is dropped when it pads this much more than vocab would.
MAX_EXTRA_PADDING = 0.10


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan:
  """The layout of one embedding table on a mesh.

  ``table_axes`` are the mesh axes the table is split over (empty when it is
  replicated), ordered so that ``token_axes`` (table axes that are also data
  axes: each rank of the group holds other tokens) come first.

  >>> p = plan_embedding(50257, 768, mesh={"data": 2, "model": 4}, tied=True)
  >>> p.strategy, p.table_axes, p.padded_shape
  ('vocab', ('model',), (50260, 768))
  """

  num_embeddings: int
  features: int
  strategy: str
  table_axes: tuple[str, ...]
  data_axes: tuple[str, ...]
  mesh_shape: tuple[tuple[str, int], ...]
  padded_shape: tuple[int, int]
  itemsize: int
  tokens: int
  bytes_per_device: int
  bytes_moved_per_lookup: int
  reason: str
  name: str = "table"

  @property
  def logical_shape(self) -> tuple[int, int]:
    return (self.num_embeddings, self.features)

  @property
  def token_axes(self) -> tuple[str, ...]:
    """Table axes over which ranks hold different tokens."""
    return tuple(a for a in self.table_axes if a in self.data_axes)

  @property
  def rest_axes(self) -> tuple[str, ...]:
    """Table axes over which ranks hold the same tokens."""
    return tuple(a for a in self.table_axes if a not in self.data_axes)

  @property
  def group_size(self) -> int:
    return mesh_axes.axes_size(dict(self.mesh_shape), self.table_axes)

  @property
  def data_shards(self) -> int:
    return mesh_axes.axes_size(dict(self.mesh_shape), self.data_axes)

  @property
  def padding_overhead(self) -> float:
    """Padded elements as a fraction of the logical table."""
    padded = self.padded_shape[0] * self.padded_shape[1]
    return padded / (self.num_embeddings * self.features) - 1.0

  @property
  def table_spec(self) -> tuple:
    """Per-dimension mesh axes of the physical table (flax ``out_sharding``)."""
    split = self.table_axes or None
    if self.strategy == options.VOCAB:
      return (split, None)
    if self.strategy == options.HIDDEN:
      return (None, split)
    return (None, None)

  @property
  def logical_spec(self) -> tuple:
    """Per-dimension mesh axes of the unpadded table (``logical_table()``).

    ``table_spec`` when nothing is padded. Else (a ``jax.Array`` can't be
    split unevenly) the even split over the most devices of the table's own
    axes: the table's group trades its pieces with an all-to-all, never
    gathering it whole. Replicated when no group of table axes divides either
    size.

    >>> plan_embedding(99, 64, mesh={"model": 4}, sharding="vocab").logical_spec
    (None, ('model',))
    >>> plan_embedding(99, 99, mesh={"model": 4}, sharding="vocab").logical_spec
    (None, None)
    """
    if self.padded_shape == self.logical_shape:
      return self.table_spec
    group = {a: n for a, n in self.mesh_shape if a in self.table_axes}
    return mesh_axes.even_split(
        self.logical_shape, group, also_divides=self.padded_shape, prefer=self.table_spec)

  @property
  def shard_shape(self) -> tuple[int, int]:
    rows, cols = self.padded_shape
    if self.strategy == options.VOCAB:
      return (rows // self.group_size, cols)
    if self.strategy == options.HIDDEN:
      return (rows, cols // self.group_size)
    return (rows, cols)

  def __str__(self) -> str:
    mesh = ", ".join(f"{a}={n}" for a, n in self.mesh_shape) or "one device"
    return "\n".join([
        f"EmbeddingPlan({self.name}: {self.num_embeddings} x {self.features})",
        f"  strategy        {self.strategy}",
        f"  mesh            {mesh}",
        f"  table_axes      {self.table_axes}  (token_axes {self.token_axes})",
        f"  data_axes       {self.data_axes}",
        f"  padded shape    {self.padded_shape[0]} x {self.padded_shape[1]}"
        f"  (+{100 * self.padding_overhead:.2f}% padding)",
        f"  shard shape     {self.shard_shape[0]} x {self.shard_shape[1]}",
        f"  bytes/device    {_human(self.bytes_per_device)}",
        f"  moved/lookup    {_human(self.bytes_moved_per_lookup)} per device"
        f" for {self.tokens} ids",
        f"  reason          {self.reason}",
    ])


def _human(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return str(n)


def check_shape(num_embeddings, features, name: str = "table") -> tuple[int, int]:
  """``(num_embeddings, features)`` as ints, or a ValueError / TypeError naming the table.

  >>> check_shape(10, 4)
  (10, 4)
  """
  return (_check_size(num_embeddings, "num_embeddings", name),
          _check_size(features, "features", name))


def _check_size(value, what: str, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name}: {what} must be an int, got {value!r}.")
  if value < 1:
    raise ValueError(
        f"{name}: {what} must be >= 1, got {value}; an embedding table needs "
        f"at least one row and one column."
    )
  return int(value)


def _choose(num_embeddings, features, group, itemsize, tied, replicate_below):
  """The auto rule: returns (strategy, reason)."""
  table = num_embeddings * features * itemsize
  if group == 1:
    return options.REPLICATED, "the table group has one device"
  if table <= replicate_below:
    return options.REPLICATED, (
        f"small table ({_human(table)} <= "
        f"{_human(replicate_below)}): a copy per device moves nothing"
    )
  if tied:
    return options.VOCAB, (
        "tied output layer: vocab rows share their layout with the "
        "vocab-sharded logits of attend()"
    )
  if num_embeddings < group:
    return options.HIDDEN, (
        f"vocabulary ({num_embeddings}) smaller than the table group ({group})"
    )
  rows, cols = cost.padded_shape(num_embeddings, features, options.HIDDEN, group)
  if cols // group < MIN_SHARD_WIDTH:
    return options.VOCAB, (
        f"width per rank ({cols // group} of {features}) too narrow for a "
        f"hidden split (< {MIN_SHARD_WIDTH})"
    )
  vrows, _ = cost.padded_shape(num_embeddings, features, options.VOCAB, group)
  extra = (cols / features - 1) - (vrows / num_embeddings - 1)
  if extra > MAX_EXTRA_PADDING:
    return options.VOCAB, (
        f"far less padding by rows ({100 * extra:.0f}% more for hidden)"
    )
  return options.HIDDEN, (
      "lookup-only table wide enough to split by columns: moves the fewest "
      "bytes (each rank sends only its slice of each row)"
  )


def plan_embedding(
    num_embeddings: int,
    features: int,
    *,
    mesh=None,
    sharding: str = options.AUTO,
    table_axes=None,
    data_axes=None,
    tied: bool = False,
    param_dtype=np.float32,
    tokens: int = 4096,
    replicate_below_bytes: int = REPLICATE_BELOW_BYTES,
    name: str = "table",
) -> EmbeddingPlan:
  """Decides how a ``(num_embeddings, features)`` table is laid out on a mesh.

  Args:
    num_embeddings: vocabulary size (rows of the logical table).
    features: embedding width (columns of the logical table).
    mesh: a ``Mesh``, an ``AbstractMesh``, a ``{axis: size}`` dict, or None
      for one device.
    sharding: ``"auto" | "replicated" | "vocab" | "hidden"``.
    table_axes: mesh axes the table is split over (default: the non-data
      axes, or all axes when every axis is a data axis).
    data_axes: mesh axes the ids' leading dimension is split over (default:
      axes named like ``data``, ``batch``, ``replica``).
    tied: the table is also the output layer (``attend``): prefer vocab.
    param_dtype: dtype of the stored table, for the byte counts.
    tokens: ids per lookup over the whole mesh, for the traffic estimate.
    replicate_below_bytes: ``auto`` replicates tables up to this size.
    name: the table's name in messages.

  Returns:
    An ``EmbeddingPlan``.

  >>> p = plan_embedding(1_000_000, 100, mesh={"batch": 8})
  >>> p.strategy, p.padded_shape, p.token_axes
  ('hidden', (1000000, 104), ('batch',))
  >>> print(p.reason)
  lookup-only table wide enough to split by columns: moves the fewest bytes (each rank sends only its slice of each row)
  """
  num_embeddings, features = check_shape(num_embeddings, features, name)
  if sharding not in (options.AUTO,) + options.STRATEGIES:
    raise ValueError(
        f"{name}: sharding={sharding!r} is not a layout; use one of "
        f"{(options.AUTO,) + options.STRATEGIES}."
    )
  shape = mesh_axes.mesh_shape(mesh, name=name)
  table, data = mesh_axes.resolve_axes(shape, table_axes, data_axes, name=name)
  # Token axes first: the hidden all-to-all then reassembles columns in the
  # order the PartitionSpec lays them out (see strategies/collectives.py).
  table = tuple(a for a in table if a in data) + tuple(
      a for a in table if a not in data
  )
  itemsize = np.dtype(param_dtype).itemsize
  group = mesh_axes.axes_size(shape, table)
  if sharding == options.AUTO:
    strategy, reason = _choose(
        num_embeddings, features, group, itemsize, tied, replicate_below_bytes
    )
  else:
    strategy, reason = sharding, f"sharding={sharding!r} was requested"
  if strategy == options.REPLICATED:
    table, group = (), 1
  padded = cost.padded_shape(num_embeddings, features, strategy, group)
  token_ranks = mesh_axes.axes_size(shape, [a for a in table if a in data])
  return EmbeddingPlan(
      num_embeddings=num_embeddings,
      features=features,
      strategy=strategy,
      table_axes=table,
      data_axes=data,
      mesh_shape=tuple(shape.items()),
      padded_shape=padded,
      itemsize=itemsize,
      tokens=tokens,
      bytes_per_device=cost.table_bytes_per_device(
          padded, strategy, group, itemsize
      ),
      bytes_moved_per_lookup=cost.bytes_moved_per_lookup(
          padded,
          strategy,
          tokens=tokens,
          data_shards=mesh_axes.axes_size(shape, data),
          token_ranks=token_ranks,
          rest_ranks=group // token_ranks,
          itemsize=itemsize,
      ),
      reason=reason,
      name=name,
  )
