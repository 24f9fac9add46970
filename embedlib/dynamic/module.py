"""``DynamicEmbed``: a table of raw ids, rows assigned on admission and freed on eviction."""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import _compat
from embedlib import _deprecated
from embedlib import kernels
from embedlib import lookahead
from embedlib import options
from embedlib import sharding as sharding_lib
from embedlib.dynamic import ids as ids_lib
from embedlib.dynamic import initializers
from embedlib.dynamic import mapping
from embedlib.dynamic import policy as policy_lib
from embedlib.dynamic import spec as spec_lib
from embedlib.dynamic import step as step_lib
from embedlib.embed import ShardedEmbed
from embedlib.strategies.request import Request
from embedlib.plan.settings import Layout
from embedlib.plan.settings import field_names as settings_fields

ZERO, LEARNED, DEFAULTS = spec_lib.ZERO, spec_lib.LEARNED, spec_lib.DEFAULTS
STATS = ("occupancy", "admitted", "evicted", "default_share")
LAYOUTS = (options.AUTO, "vocab", "routed", "replicated")


class DynamicMap(nnx.Variable):
  """The id -> row map of a ``DynamicEmbed``: keys, scores, sketch, clock, init key."""


class DynamicStats(nnx.Variable):
  """The last training step's statistics of a ``DynamicEmbed`` (``STATS``)."""


class DynamicEmbed(nnx.Module):
  """An embedding table of raw ids: rows are given on admission, taken back on eviction.

  >>> import numpy as np
  >>> from flax import nnx
  >>> import embedlib
  >>> emb = embedlib.DynamicEmbed(256, 4, rngs=nnx.Rngs(0))
  >>> ids = np.array([2**40 + 7, 3, 2**40 + 7, -1], np.int64)
  >>> rows = emb.rows_of(ids)           # training mode: admits on lookup
  >>> bool(rows[0] == rows[2] and rows[0] != rows[1]), int(rows[3])
  (True, -1)
  >>> emb(ids).shape
  (4, 4)
  >>> emb.stats()["admitted"], emb.stats()["occupancy"]
  (0, 0.0078125)

  Its ``capacity`` rows form ``capacity / bucket_size`` buckets; a hash of
  the raw id picks the bucket, which admits and evicts on its own (the exact
  rules: ``embedlib.dynamic.policy``). Distinct resident ids never share a
  row. An id that is not resident (not admitted yet, or turned away by a
  full bucket) reads the default row: zeros, or one learned row
  (``default="learned"``); its gradient reaches no resident row. The
  padding id (``-1``, ``2**64 - 1``) reads zeros and is never admitted. A
  placed row starts from ``embedding_init`` drawn for its row number with
  the init key, the same on any device count: the table is created with
  every row at that value, so a row's first placement draws nothing, and a
  row placed again after an eviction is drawn again. (A table trained
  densely changes its unplaced rows too; ``dynamic.reset_slots``, called
  each step, then has their first placement drawn as well.) The default
  initializer, ``dynamic.HashedUniform()``, is uniform with the variance of
  ``nnx.Embed``'s default (``1 / features``), each value a hash of (key,
  row, column): cheap to draw, the same bits in every program. Any flax
  initializer may be given instead (``nnx.Embed``'s normal one:
  ``flax.nnx.nn.linear.default_embed_init``); it is drawn with the init key
  folded with the row number.

  In training mode (nnx's default) a lookup updates the map; after
  ``eval()`` it only reads it. Each training-mode call (``__call__``,
  ``bag``, ``rows_of``) is one step of the policy and advances its clock:
  a model that reads one table for several features should make one call
  (concatenate the ids) so that they count as one step.

  Ids: numpy (or Python) integers of any dtype, split exactly into two
  uint32 words on the host (64-bit values past ``2**32`` with x64 off
  included); device arrays of 32-bit ids (signed sign-extend, unsigned
  zero-extend); or ``embedlib.dynamic.Words`` (uint32 ``[..., 2]`` words),
  what a jitted step should take for 64-bit ids.

  On a mesh the rows are split in contiguous blocks over ``table_axes``
  (the vocab or routed layout of ``ShardedEmbed``), each device owning whole
  buckets with their part of the map, and ids are routed to their owners
  with an all-to-all (see ``embedlib.dynamic.mapping``), so the number of
  buckets must divide by the group size. The mesh is read as every table
  reads it: ``mesh=``, else the one set with ``jax.set_mesh``.

  Args:
    capacity: rows; a multiple of the bucket size.
    features: embedding width.
    dynamic: a ``DynamicSpec``: the admission and eviction policy, the
      bucket size (default: the largest up to 128 that splits each device's
      rows), the default row and the ids' dtype. None: its defaults.
    mesh: a ``Mesh`` or ``AbstractMesh``; None takes the one set with
      ``jax.set_mesh``, or one device when there is none.
    layout: an ``embedlib.Layout`` of ``sharding`` (``"auto"``: vocab on a
      mesh, else replicated; ``"vocab"``, ``"routed"``, ``"replicated"``),
      ``table_axes``, ``data_axes`` and ``route_capacity``: ids one rank
      sends each owner of the map per step (``embedlib.dynamic.mapping``;
      None: twice the even share; a step needing more takes the all-gather
      path, with the same result). The keywords these replace
      (``bucket_size=``, ``sharding=``, ...) still work until embedlib 0.2,
      with a ``DeprecationWarning``.
    name: the table's name in errors and statistics.
    dtype, param_dtype: as ``nnx.Embed``'s.
    embedding_init: a placed row's initial value; default
      ``dynamic.HashedUniform()`` (see above).
    rngs: ``rngs.params()`` draws the init key.
  """

  @_deprecated.moved_keywords("DynamicEmbed", {
      "layout": (Layout, "embedlib.Layout"),
      "dynamic": (spec_lib.DynamicSpec, "embedlib.DynamicSpec")})
  def __init__(
      self,
      capacity: int,
      features: int,
      *,
      dynamic: spec_lib.DynamicSpec | None = None,
      mesh=None,
      layout: Layout | None = None,
      name: str = "dynamic",
      dtype: tp.Any = None,
      param_dtype: tp.Any = jnp.float32,
      embedding_init: tp.Callable = initializers.HashedUniform(),
      rngs: nnx.Rngs,
  ):
    dynamic = spec_lib.DynamicSpec() if dynamic is None else dynamic
    layout = Layout() if layout is None else layout
    sharding = _check_layout(layout, name)
    route_capacity = _route_capacity(layout, dynamic, name)
    mesh = sharding_lib.mesh_or_current(mesh)
    if sharding == options.AUTO:
      sharding = "replicated" if mesh is None else "vocab"
    self.name = name
    self.id_dtype = None if dynamic.id_dtype is None else str(np.dtype(dynamic.id_dtype))
    self.default = dynamic.default
    self.route_capacity = route_capacity
    self.embedding_init = embedding_init
    self.deterministic = False
    # Two keys, as when the table was made of zeros with a key of its own:
    # every module made after this one keeps its initial values.
    _, key = rngs.params(), rngs.params()
    # Every row starts at its initial value, so a first placement draws nothing.
    self.rows = ShardedEmbed(
        capacity, features, mesh=mesh, layout=Layout(
            sharding=sharding, table_axes=layout.table_axes, data_axes=layout.data_axes),
        name=name, dtype=dtype, param_dtype=param_dtype,
        embedding_init=_ByRow(embedding_init), rngs=_GivenKey(key))
    plan = self.rows.plan
    self.mesh = self.rows.mesh
    self.table_axes = tuple(plan.table_axes) if plan.strategy != "replicated" else ()
    group = math.prod(dict(plan.mesh_shape)[a] for a in self.table_axes) if self.table_axes else 1
    self.policy = dynamic.policy(capacity, group=group, name=name)
    bucket_size = self.policy.bucket_size
    if self.policy.num_buckets % group or plan.padded_shape[0] != capacity:
      raise ValueError(
          f"{name}: capacity={capacity} holds {self.policy.num_buckets} buckets of "
          f"{bucket_size}, which do not split evenly over the {group} devices of table "
          f"axes {self.table_axes} (devices own whole buckets); use a capacity that "
          f"is a multiple of bucket_size * {group} = {bucket_size * group}, or a "
          "smaller bucket_size.")
    self.group = group
    self.features = features
    split_spec = P(self.table_axes or None)
    split, every = self._place(split_spec), self._place(P())
    n, nb = capacity, self.policy.num_buckets
    as_map = lambda v, spec: DynamicMap(v, **self._metadata(spec))
    self.keys_hi = as_map(jnp.zeros((n,), jnp.uint32, device=split), split_spec)
    self.keys_lo = as_map(jnp.zeros((n,), jnp.uint32, device=split), split_spec)
    self.score = as_map(jnp.full((n,), policy_lib.EMPTY, jnp.int32, device=split), split_spec)
    self.sketch = (as_map(jnp.zeros((nb, self.policy.sketch_depth, self.policy.width),
                                    jnp.uint8, device=split), split_spec)
                   if self.policy.uses_sketch else None)
    self.placed_at = as_map(jnp.full((n,), mapping.NEVER_PLACED, jnp.int32, device=split),
                            split_spec)
    self.clock = as_map(jnp.zeros((), jnp.int32, device=every), P())
    self.slots_clock = as_map(jnp.zeros((), jnp.int32, device=every), P())
    self.init_key = as_map(jax.device_put(jax.random.key_data(key), every), P())
    self.last = DynamicStats(jnp.zeros((len(STATS),), jnp.float32, device=every),
                             **self._metadata(P()))
    self.default_row = (nnx.Param(jnp.zeros((features,), param_dtype, device=every),
                                  **self._metadata(P()))
                        if dynamic.default == LEARNED else None)

  def _metadata(self, spec) -> dict:
    """Sharding metadata, which lays the variables out under ``nnx.eval_shape`` too."""
    if self.mesh is None:
      return {}
    return {"out_sharding": tuple(spec), "mesh": self.mesh}

  def _place(self, spec):
    if self.mesh is None or not sharding_lib.has_devices(self.mesh):
      return None
    return NamedSharding(self.mesh, spec)

  # -- ids -------------------------------------------------------------------

  def words(self, ids) -> ids_lib.Words:
    """Any accepted ids as ``Words`` (host ids range-checked against ``id_dtype``)."""
    if isinstance(ids, ids_lib.Words):
      return ids
    if isinstance(ids, jax.Array) or isinstance(ids, jax.core.Tracer):
      return ids_lib.device_words(ids, name=self.name)
    return ids_lib.words(ids, id_dtype=self.id_dtype, name=self.name)

  def _state(self) -> step_lib.MapState:
    return step_lib.MapState(self.keys_hi[...], self.keys_lo[...], self.score[...],
                             None if self.sketch is None else self.sketch[...])

  def rows_of(self, ids) -> jax.Array:
    """Each id's row (``-1``: the default), admitting and evicting in training mode.

    Returns:
      int32 ``ids.shape``.
    """
    w = self.words(ids)
    flat = w.value.reshape(-1, 2)
    train = not self.deterministic
    scope = lookahead.active()
    if train and scope is not None:
      return self._rows_ahead(scope, flat).reshape(w.shape)
    clock = self.clock[...]
    # An eval lookup places no row, so it needs no table (nor one a quantized table lacks).
    state, placed_at, table, rows, stats = self._run(
        self._state(), self.placed_at[...], clock,
        self.rows.embedding[...] if train else None, flat, train)
    if train:
      self._commit(state, placed_at, clock + 1, stats)
      _compat.assign(self.rows.embedding, table)
    return rows.reshape(w.shape)

  def _run(self, state, placed_at, clock, table, flat, train):
    out = mapping.run(
        state, placed_at, None if table is None else jax.lax.stop_gradient(table),
        self.init_key[...], clock, flat, policy=self.policy,
        mesh=self.mesh, table_axes=self.table_axes, train=train, init=self.embedding_init,
        table_spec=tuple(self.rows.plan.table_spec), capacity=self.route_capacity)
    if table is None:
      return out
    return out[:2] + (_placed(table, out[2]),) + out[3:]

  def _commit(self, state, placed_at, clock, stats) -> None:
    """Keeps a training step's map, clock and statistics."""
    for variable, value in zip((self.keys_hi, self.keys_lo, self.score), state[:3]):
      _compat.assign(variable, value)
    if self.sketch is not None:
      _compat.assign(self.sketch, state.sketch)
    _compat.assign(self.clock, clock)
    _compat.assign(self.placed_at, placed_at)
    lookups = jnp.maximum(stats[4], 1).astype(jnp.float32)
    _compat.assign(self.last, jnp.stack([
        stats[0] / self.policy.capacity, stats[1], stats[2], stats[3] / lookups
    ]).astype(jnp.float32))

  def _rows_ahead(self, scope, flat) -> jax.Array:
    """A training lookup under a pipelined step's scope (``embedlib.lookahead``).

    Collecting, the map steps on the ids from where the batch before left it
    (``MapAhead``) and the rows stay as they are; using, the step keeps that
    map and places its new rows (``mapping.place``), after the previous
    step's update as in line, before they are read.
    """
    key = (self.name, (tuple(flat.shape),), "map")

    def collect(scope):
      before = scope.previous_value(key)
      if before is None:   # the first batch read ahead: the map as it stands
        before = MapAhead(self._state(), self.placed_at[...], self.clock[...], None, None)
      state, placed_at, _, rows, stats = self._run(
          before.state, before.placed_at, before.clock, None, flat, train=True)
      return MapAhead(state, placed_at, before.clock + 1, stats, rows), rows

    def use(ahead):
      before = self.placed_at[...]
      self._commit(ahead.state, ahead.placed_at, ahead.clock, ahead.stats)
      table = self.rows.embedding[...]
      _compat.assign(self.rows.embedding, _placed(table, mapping.place(
          jax.lax.stop_gradient(table), ahead.placed_at, before, ahead.clock, self.init_key[...],
          mesh=self.mesh, table_axes=self.table_axes, init=self.embedding_init,
          table_spec=tuple(self.rows.plan.table_spec), bound=flat.shape[0])))
      return ahead.rows

    return lookahead.read_ahead(scope, key, collect, use)

  def stats(self) -> dict:
    """The last training step's ``occupancy`` (resident share of rows),
    ``admitted``, ``evicted`` and ``default_share`` (share of non-padding
    lookups reading the default row), as Python numbers."""
    values = np.asarray(self.last[...])
    return {k: (int(v) if k in ("admitted", "evicted") else float(v))
            for k, v in zip(STATS, values)}

  def map_bytes_per_device(self) -> int:
    """Bytes of the id -> row map on each device.

    Its keys, scores, placement clocks and sketch are split with the rows
    (whole buckets a device); the clocks, init key and statistics are on
    every device.
    """
    size = lambda v: math.prod(v[...].shape) * np.dtype(v[...].dtype).itemsize
    split = (self.keys_hi, self.keys_lo, self.score, self.placed_at, self.sketch)
    every = (self.clock, self.slots_clock, self.init_key, self.last)
    return (sum(size(v) for v in split if v is not None) // self.group
            + sum(size(v) for v in every))

  def resident(self) -> dict[int, int]:
    """Every resident raw id (as a uint64 value) and its row; gathers the map to the host."""
    hi, lo, score = (np.asarray(v[...]) for v in (self.keys_hi, self.keys_lo, self.score))
    rows = np.flatnonzero(score >= 0)
    return {(int(hi[r]) << 32) | int(lo[r]): int(r) for r in rows}

  # -- lookups ---------------------------------------------------------------

  def __call__(self, ids) -> jax.Array:
    """Embeds raw ids: ``ids.shape + (features,)`` (``Words``: their ``shape``)."""
    (out,) = self.lookup_requests((Request(ids),))
    return out

  def bag(self, ids, weights=None, *, combiner: str = "sum") -> jax.Array:
    """Pooled lookup of padded bags of raw ids: ``[batch, bag]`` to ``[batch, features]``.

    Every id but padding is a member (a non-resident one reads the default
    row): ``mean`` divides by the members' summed weights, ``sqrtn`` by
    the root of their summed squares.
    """
    (out,) = self.lookup_requests((Request(ids, weights, combiner),))
    return out

  def lookup_requests(self, requests, *, num_unique: int | None = None,
                      on_overflow: str | None = None, checks: list | None = None) -> tuple:
    """Several lookups as one step of the policy: ``ShardedEmbed.lookup_requests`` of raw ids.

    Each ``Request``'s ids are raw ids (``words``); a ``combiner`` of None
    returns rows (``__call__``), otherwise pooled bags (``bag``). Every
    request's ids are admitted together, so features that share the table
    count as one step (what ``EmbeddingCollection`` does).

    Args:
      requests: ``Request`` s of raw ids.
      num_unique: None: a dynamic table doesn't dedup.
      on_overflow: unused: a step routing more ids than ``route_capacity``
        takes the all-gather path, with the same result, and nothing to
        raise (accepted so that every table kind takes one call).
      checks: unused: nothing is left to check after the lookups.

    Returns:
      One output per request: ``ids.shape + (features,)`` unpooled,
      ``[batch, features]`` pooled.
    """
    del on_overflow, checks
    if num_unique is not None:
      raise ValueError(f"{self.name}: num_unique={num_unique}, but a dynamic table looks "
                       "its ids up without dedup; pass num_unique=None.")
    ws = []
    for r in requests:
      w = self.words(r.ids)
      r.check_bag(self.name, w.shape)
      ws.append(w)
    flat = ids_lib.Words(jnp.concatenate([w.value.reshape(-1, 2) for w in ws]))
    rows = self.rows_of(flat)
    out, start = [], 0
    for w, r in zip(ws, requests):
      size = math.prod(w.shape)
      part = rows[start:start + size].reshape(w.shape)
      start += size
      out.append(self._pool(w, part, r.weights, r.combiner) if r.pooled
                 else self._embed(w, part))
    return tuple(out)

  def lookup_many(self, requests) -> list[jax.Array]:
    """``lookup_requests`` of ``[(ids, weights, combiner)]`` (deprecated: pass ``Request`` s)."""
    _deprecated.warn(
        f"DynamicEmbed.lookup_many is deprecated and will be removed in "
        f"{_deprecated.REMOVED_IN}; call lookup_requests([Request(ids, weights, combiner), "
        "...]) as every table kind takes it.")
    return list(self.lookup_requests([Request(*r) for r in requests]))

  def _embed(self, w: ids_lib.Words, rows) -> jax.Array:
    out = self.rows(rows)
    if self.default_row is not None:
      use = (rows < 0) & ~_padding(w)
      out = out + jnp.where(use[..., None], self.default_row[...].astype(out.dtype), 0)
    return out

  def _pool(self, w: ids_lib.Words, rows, weights, combiner: str) -> jax.Array:
    member = ~_padding(w)
    coef = kernels.bag_coefficients(jnp.where(member, 0, -1), weights, 1, combiner)
    out = self.rows.bag(rows, coef, combiner="sum")
    if self.default_row is not None:
      share = jnp.sum(jnp.where(member & (rows < 0), coef, 0.0), axis=1)
      out = out + share[:, None].astype(out.dtype) * self.default_row[...].astype(out.dtype)
    return out


def _check_layout(layout: Layout, name: str) -> str:
  """``layout``'s sharding, after checking it asks only what a dynamic table does."""
  if not isinstance(layout, Layout):
    raise TypeError(f"{name}: layout={layout!r}; pass an embedlib.Layout(...) or None.")
  unused = [f for f in _NOT_DYNAMIC if getattr(layout, f) != getattr(_DEFAULT_LAYOUT, f)]
  if unused:
    raise ValueError(
        f"{name}: Layout({unused[0]}=...) is not a dynamic table's setting; a DynamicEmbed "
        f"takes {', '.join(_DYNAMIC_LAYOUT)} (its rows are split in whole buckets).")
  if layout.sharding not in LAYOUTS:
    raise ValueError(
        f"{name}: sharding={layout.sharding!r}; a dynamic table's rows are split in whole "
        f"buckets, so use one of {LAYOUTS}.")
  return layout.sharding


def _route_capacity(layout: Layout, dynamic, name: str):
  """The route capacity, from ``layout`` or (a collection's table) its ``DynamicSpec``."""
  if None not in (layout.route_capacity, dynamic.route_capacity) and (
      layout.route_capacity != dynamic.route_capacity):
    raise ValueError(
        f"{name}: route_capacity is given twice, {layout.route_capacity} in the Layout and "
        f"{dynamic.route_capacity} in the DynamicSpec; give it once, in the Layout.")
  return layout.route_capacity if layout.route_capacity is not None else dynamic.route_capacity


_DYNAMIC_LAYOUT = ("sharding", "table_axes", "data_axes", "route_capacity")
_DEFAULT_LAYOUT = Layout()
_NOT_DYNAMIC = tuple(f for f in settings_fields(Layout) if f not in _DYNAMIC_LAYOUT)


@dataclasses.dataclass(frozen=True)
class _ByRow:
  """``ShardedEmbed``'s initializer for a dynamic table: ``mapping.initial_table``.

  Hashable by its initializer, so tables alike share one compiled draw.
  Compiled with XLA's default passes (``compiler_options``, read by
  ``embedlib.table``), as the steps that draw rows again are.
  """

  init: tp.Callable
  compiler_options: tp.ClassVar[dict] = {}

  def __call__(self, key, shape, dtype):
    return mapping.initial_table(self.init, key, shape, dtype)


class _GivenKey:
  """Hands ``ShardedEmbed`` the table's init key as its ``rngs.params()``."""

  def __init__(self, key):
    self.key = key

  def params(self):
    return self.key


class MapAhead(tp.NamedTuple):
  """A map's training step made a step ahead (a pipelined step's distribution).

  ``state``, ``placed_at``, ``clock`` (after the step) and ``stats`` as
  ``mapping.run`` gives them, ``rows`` int32 ``[m]`` the ids' rows.
  """

  state: step_lib.MapState
  placed_at: jax.Array
  clock: jax.Array
  stats: tp.Any
  rows: tp.Any


@jax.custom_jvp
def _placed(table, placed):
  """``placed``, the table with this step's new rows placed, differentiated as ``table``.

  A table trained densely (tied to an output layer) is differentiated
  through the lookup: the placement's kernel has no derivative, and a
  placed row's gradient is the loss's at the value it was read with, so
  the tangent passes through as the identity.
  """
  del table
  return placed


@_placed.defjvp
def _placed_jvp(primals, tangents):
  return primals[1], tangents[0]


def _padding(w: ids_lib.Words):
  pad = jnp.uint32(ids_lib.PAD_WORD)
  return (w.hi == pad) & (w.lo == pad)
