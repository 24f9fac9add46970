"""``Layout`` and ``CollectionLayout``: every planning setting of a table or a collection, in one value.

A table's constructor takes the table's own arguments (sizes, name, dtypes,
initializer, ``rngs``) and one ``layout=``: how its rows are placed on the
mesh and how its lookups reach them. Left at their defaults, the planner
chooses (``plan_embedding``, ``plan_collection``). The values are checked
where the table is built, so that an error names the table.

>>> from embedlib.plan import Layout, plan_embedding
>>> layout = Layout(sharding="vocab", table_axes=("model",))
>>> p = plan_embedding(1000, 8, mesh={"data": 2, "model": 4}, **layout.planner_settings())
>>> p.strategy, p.table_axes, p.data_axes
('vocab', ('model',), ('data',))
"""

from __future__ import annotations

import dataclasses
import typing as tp

from embedlib import options
from embedlib.plan import memory as memory_lib


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one table is laid out over the mesh and looked up there.

  Attributes:
    sharding: ``"auto" | "replicated" | "vocab" | "hidden" | "routed" |
      "grid"`` (``options.STRATEGIES``); ``auto`` lets the planner choose.
    table_axes: mesh axes the table is split over (see ``plan_embedding``);
      a grid's rows.
    column_axes: a grid's column axes (``sharding="grid"``; default the
      data axes that are not table axes).
    data_axes: mesh axes the ids' leading dimension is split over.
    tied: the table is also the output layer (``attend``); auto picks vocab.
    kernel: local lookup, one of ``options.KERNELS`` (``kernels.plan``:
      auto is XLA's ops on GPU where measured faster than Pallas, the C++
      gather on CPU, chosen per platform when the program is lowered).
    invalid_ids: ``"zero"`` (an invalid id reads zeros) or ``"error"``
      (see ``embedlib.invalid_ids``).
    route_capacity: ids per destination of a routed lookup; None sizes it
      from each call's ids (``EmbeddingPlan.capacity_for``).
    on_overflow: a routed call with more ids for one owner than the
      capacity takes the vocab path (``"fallback"``, the same result) or
      raises (``"error"``, under ``jit`` through ``checkify``).
    devices_per_node: devices one node holds, in the table group's rank
      order; a routed table over several nodes then routes inside each
      node first and sends each row across once per node pair (see
      ``plan_embedding``). None reads it from the devices.
    node_capacity: distinct ids per destination rank that one node sends
      across nodes in that route; None plans it for uniform ids.
    ids_per_device: ids one device looks up per call, for the plan's costs
      and ``auto``'s choice.
    replicate_below_bytes: ``auto`` replicates tables up to this size.
    device_memory_bytes: what one device may spend on the table's training
      step (the table, the optimizer's slots, the ids and temporaries);
      ``auto`` takes the cheapest layout that fits, a grid where no 1-D one
      does.
    optimizer: the sparse optimizer that trains the table, whose slots count
      against ``device_memory_bytes``: a name (``"rowwise_adagrad"``, the
      default; ``"sgd"``, ...), a row-wise rule of ``embedlib.optim``, or
      None for none.
    placement: a ``plan.placement.Placement``: the table is a stack of
      tables, each placed whole on a device, on a host's devices or on all
      (the collection builds these); ``num_embeddings`` is their sum.
  """

  sharding: str = options.AUTO
  table_axes: tp.Any = None
  column_axes: tp.Any = None
  data_axes: tp.Any = None
  tied: bool = False
  kernel: str = options.AUTO
  invalid_ids: str = "zero"
  route_capacity: int | None = None
  on_overflow: str = options.FALLBACK
  devices_per_node: int | None = None
  node_capacity: int | None = None
  ids_per_device: int | None = None
  replicate_below_bytes: int | None = None
  device_memory_bytes: int | None = None
  optimizer: tp.Any = memory_lib.DEFAULT_OPTIMIZER
  placement: tp.Any = None

  def planner_settings(self) -> dict:
    """The keyword arguments of ``plan_embedding``; unset ones are left to its defaults."""
    out = {}
    for field in _PLANNED:
      value = getattr(self, field)
      if value is not None or field in _PASSED_AS_NONE:
        out[field] = value
    return out


#: ``Layout`` fields that ``plan_embedding`` reads, in its order.
_PLANNED = ("sharding", "table_axes", "column_axes", "data_axes", "tied", "ids_per_device",
            "route_capacity", "replicate_below_bytes", "placement", "device_memory_bytes",
            "devices_per_node", "node_capacity", "optimizer")
#: ... of which None means something to the planner (its own default for the rest).
_PASSED_AS_NONE = ("table_axes", "column_axes", "data_axes", "route_capacity", "placement",
                   "optimizer")


@dataclasses.dataclass(frozen=True)
class CollectionLayout:
  """How an ``EmbeddingCollection`` lays its tables out and looks them up.

  A table's own layout request is in its ``TableSpec`` (``sharding``,
  ``device``, ``host``, ``column_axes``); what is here applies to all.

  Attributes:
    table_axes: mesh axes tables are split over (see ``plan_embedding``).
    data_axes: mesh axes the batch is split over.
    kernel: local lookup kernel, one of ``options.KERNELS``.
    num_unique: dedup capacity per data shard: an int for every table, a
      ``{table: capacity}`` dict, None (no dedup), or ``"auto"`` (the
      default; also as a dict value): the planner dedups a routed table or
      stack where routing its expected distinct ids moves fewer bytes
      (``plan_collection``), and no other table; with ``on_overflow="error"``
      only a capacity given as an int dedups.
    route_capacity: ids per destination of the routed tables' lookups: an
      int for every table, a ``{table: capacity}`` dict, or None to size
      each from its call's ids (``EmbeddingPlan.capacity_for``).
    on_overflow: ``"fallback" | "error"``, for ``num_unique`` and for the
      route: a shard with more distinct ids than ``num_unique``, or a rank
      with more ids for one owner than the route capacity, takes the path
      without it for that step (the same result), or raises.
    batch_size: samples per step, for the plan's traffic estimates and its
      memory check.
    replicate_below_bytes: the per-table auto rule's replication threshold.
    replicate_budget_bytes: replicate tables together up to this many bytes
      per device (see ``plan_collection``).
    table_batched: stack the tables of one width that are placed whole on
      a device or a host (``TableSpec(sharding="table" | "table_row")``)
      and the row-wise routed ones, one routed lookup per stack.
    devices_per_host: devices of one host in the mesh's order, for
      table-row-wise placement; None reads it from the devices.
    device_memory_bytes: what a device may spend on the embedding's training
      step: its tables' shards, the ``optimizer``'s slots, the ids and the
      temporaries. An auto table takes the cheapest layout whose step fits;
      the plan raises, naming what it counted and the fix, if the whole
      doesn't (``plan_collection``).
    optimizer: the sparse optimizer that trains the tables, whose slots count
      against ``device_memory_bytes``: a name (``"rowwise_adagrad"``, the
      default; ``"sgd"``, ...), a row-wise rule of ``embedlib.optim``, or
      None for none.
    devices_per_node: devices one node holds, in the table group's rank
      order, for every table and stack (see ``plan_embedding``): a routed
      table or stack over several nodes routes inside each node first and
      sends each row across once per node pair where that pays, and the
      plan weighs a byte across nodes as ``cost.INTER_NODE_WEIGHT``. It
      must divide the table group. None reads it from the devices.
    node_capacity: distinct ids per destination rank that one node sends
      across nodes in that route: an int for every table, a ``{table or
      stack: capacity}`` dict, or None to plan it for each table's
      ``id_skew``.
  """

  table_axes: tp.Any = None
  data_axes: tp.Any = None
  kernel: str = options.AUTO
  num_unique: tp.Any = options.AUTO
  route_capacity: tp.Any = None
  on_overflow: str = options.FALLBACK
  batch_size: int = 4096
  replicate_below_bytes: int | None = None
  replicate_budget_bytes: int | None = None
  table_batched: bool = False
  devices_per_host: int | None = None
  device_memory_bytes: int | None = None
  optimizer: tp.Any = memory_lib.DEFAULT_OPTIMIZER
  devices_per_node: int | None = None
  node_capacity: tp.Any = None


def field_names(cls) -> tuple[str, ...]:
  """The settings ``cls`` holds (a ``Layout``-like dataclass)."""
  return tuple(f.name for f in dataclasses.fields(cls))
