"""The dynamic map over a mesh: each device runs the policy on the buckets it owns.

Buckets are contiguous row blocks and the rows are split over the table
axes in contiguous blocks, so device ``d`` of the table group owns buckets
``[d * B / G, (d + 1) * B / G)`` and their rows, keys, scores and sketch:
no device holds the whole map.

The step's ``M`` ids are split over the group (``M / G`` a rank; ranks
outside the group hold copies, so each copy of the map makes the same
step). Each rank routes its ids to their owners as the routed layout does
(``strategies.unique.bucketize``, a static ``capacity`` per owner, then one
``all_to_all`` of id words, 8 bytes each), the owner runs
``step.admit_step`` on every id of its buckets, and a second ``all_to_all``
hands each id its row (4 bytes): about ``12 * 2 * M / G`` bytes a rank with
the default capacity. The policy is the same whatever order ids arrive in,
so the owner's step equals the reference's. A step with more ids for one
owner than the capacity takes the all-gather path instead (``lax.cond`` on
the group's largest count; the same result): every rank gets every id
(``8 * M`` bytes), owners step their buckets, and a ``psum`` of an int32 per
id hands back the rows (an owner adds ``row + 1``, the others 0). A batch
that doesn't split evenly over the group always takes that path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from embedlib import sharding as sharding_lib
from embedlib.dynamic import draws
from embedlib.dynamic import ids as ids_lib
from embedlib.dynamic import initializers
from embedlib.dynamic import policy as policy_lib
from embedlib.dynamic import step as step_lib
from embedlib.kernels import cpu_library
from embedlib.kernels import dynamic_map_cpu
from embedlib.kernels import platforms
from embedlib.strategies import unique as unique_lib


#: ``placed_at`` of a row that still holds the value the table was created
#: with. A table is created with every row at its initial value
#: (``initial_table``), so a row's first placement draws nothing; a row
#: placed again (after an eviction) is drawn again. ``reset_slots`` marks the
#: unplaced rows of a table it trains densely as placed at 0 before the first
#: dense update, so that they are drawn when they are placed.
NEVER_PLACED = -1


def _own(flat, policy, index, group):
  hi, lo = flat[:, 0], flat[:, 1]
  pad = (hi == jnp.uint32(ids_lib.PAD_WORD)) & (lo == jnp.uint32(ids_lib.PAD_WORD))
  bucket = ids_lib.bucket_of(hi, lo, policy.num_buckets)
  per = policy.num_buckets // group
  own = ~pad & (bucket // per == index)
  return hi, lo, own, bucket - index * per, per * policy.bucket_size


def _global(rows, stats, own, offset):
  """Local rows as global ones (``-1`` stays), and the own ids counted after ``stats``."""
  rows = jnp.where(rows >= 0, rows + offset, -1)
  return rows, jnp.concatenate([stats, jnp.sum(own, keepdims=True).astype(jnp.int32)])


def _local(state, extra, clock, flat, *, policy, train, index, group, init):
  placed_at, table, key_data = extra
  if train and table is not None and _draws_in_place(init, table):
    state, placed_at, table, rows, stats = _step_and_place(
        state, placed_at, table, key_data, clock, flat, index, group, policy=policy, init=init)
    return state, (placed_at, table), rows, stats
  hi, lo, own, bucket, rows_per = _own(flat, policy, index, group)
  if train:
    state, rows, placed, stats = step_lib.admit_step(
        state, hi, lo, own, bucket, clock, policy=policy)
    # The rows placed here start again: their first value and a fresh clock mark.
    placed_at, drawn = _mark_placed(placed_at, rows, placed, clock + 1)
    if table is not None:
      table = _place_rows(init, key_data, table, drawn, index * rows_per)
  else:
    rows = step_lib.lookup(state, hi, lo, own, bucket, bucket_size=policy.bucket_size)
    placed = jnp.zeros(rows.shape, bool)
    stats = jnp.stack([jnp.sum(state.score >= 0), jnp.int32(0), jnp.int32(0),
                       jnp.sum(own & (rows < 0))]).astype(jnp.int32)
  rows, stats = _global(rows, stats, own, index * rows_per)
  return state, (placed_at, table), rows, stats


def _step_and_place(state, placed_at, table, key_data, clock, flat, index, group, *, policy,
                    init):
  """The map's step on shard ``index`` of ``group`` for ``flat`` uint32 ``[m, 2]``
  id words, then the placed rows' marks and their initial values, for the
  default initializer (``_draws_in_place``).

  On CPU one kernel does it all (``dynamic_map_cpu.map_step_place_cpu``):
  it finds each id's bucket and owner as ``_own`` does, and marks and draws
  the rows while it steps each bucket, with the bucket in the caches, where
  XLA ops before it, the map's step, the marking and the draws were apart.
  Elsewhere, and for an empty step, those apart, with the same results.

  Returns:
    ``(state, placed_at, table, rows, stats)``, rows global and stats
    int32 ``[5]`` as ``_local`` returns them.
  """
  def apart(state, placed_at, table, key_data, clock, flat, index):
    hi, lo, own, bucket, rows_per = _own(flat, policy, index, group)
    state, rows, placed, stats = step_lib.admit_step(
        state, hi, lo, own, bucket, clock, policy=policy)
    placed_at, drawn = _mark_placed(placed_at, rows, placed, clock + 1)
    table = _place_rows(init, key_data, table, drawn, index * rows_per)
    return (state, placed_at, table) + _global(rows, stats, own, index * rows_per)

  def together(state, placed_at, table, key_data, clock, flat, index):
    khi, klo, score, sketch, rows, _, stats, placed_at, table = (
        dynamic_map_cpu.map_step_place_cpu(
            state.keys_hi, state.keys_lo, state.score, state.sketch, flat, clock, placed_at,
            table, jnp.stack(initializers.key_words(key_data)), index,
            num_buckets=policy.num_buckets, never=NEVER_PLACED,
            step=init.step(table.shape[1]), **step_lib.cpu_attributes(policy)))
    return step_lib.MapState(khi, klo, score, sketch), placed_at, table, rows, stats

  args = (state, placed_at, table, key_data, clock, flat, jnp.asarray(index, jnp.int32))
  if flat.shape[0] == 0:
    return apart(*args)
  return platforms.by_platform(*args, cpu=together, gpu=apart, default=apart)


def _mark_placed(placed_at, rows, placed, stamp):
  """``placed_at`` with the placed rows marked ``stamp``, and the rows to draw.

  A row placed for the first time holds its initial value already, so only
  the rows placed again are drawn: ``drawn`` int32 ``[m]`` is the row where
  its old mark is not ``NEVER_PLACED``, else ``len(placed_at)``. On CPU a
  kernel does it in one pass (``dynamic_map_cpu.mark_placed_cpu``, the same
  arrays), where XLA copies the marks around its gather and scatter.
  """
  def xla(placed_at, rows, placed, stamp):
    n = placed_at.shape[0]
    again = placed_at[jnp.clip(rows, 0, n - 1)] != NEVER_PLACED
    drawn = jnp.where(placed & again, rows, n)
    return placed_at.at[jnp.where(placed, rows, n)].set(stamp, mode="drop"), drawn

  args = (placed_at, rows, placed, stamp)
  if rows.shape[0] == 0 or not cpu_library.available():
    return xla(*args)
  cpu = functools.partial(dynamic_map_cpu.mark_placed_cpu, never=NEVER_PLACED)
  return platforms.by_platform(*args, cpu=cpu, gpu=xla, default=xla)


#: Rows drawn and placed at a time: a step draws its placed rows rounded up
#: to a multiple of this, never an ``[ids, features]`` block.
PLACE_CHUNK = 1024


def place_chunk(m: int) -> int:
  """Rows a step of ``m`` ids draws at a time: ``PLACE_CHUNK``, or ``m`` when smaller.

  >>> place_chunk(65_536), place_chunk(100)
  (1024, 100)
  """
  return max(1, min(PLACE_CHUNK, m))


def _place_rows(init, key_data, table, put, offset):
  """``table`` with the rows ``put`` (local; ``>= len(table)``: none) set to their
  initial values (global row ``put + offset``).

  The placed rows are packed first, then drawn and written ``place_chunk``
  at a time in a loop that runs only as many chunks as rows are placed: a
  row's values depend on its number alone (``init_rows``), so chunks give
  the values one draw of them all would. The table is the loop's carry,
  updated in place, and no ``[ids, features]`` block of draws is built.
  """
  if _draws_in_place(init, table):
    # The default initializer on CPU: one kernel draws the values straight
    # into the rows, skipping the packing and the chunks (a table that
    # evicts places tens of thousands of rows again each step).
    xla = functools.partial(_place_rows_xla, init, key_data, offset=offset)
    cpu = functools.partial(_place_hashed_uniform, init, key_data, offset=offset)
    return platforms.by_platform(table, put, cpu=cpu, gpu=xla, default=xla)
  return _place_rows_xla(init, key_data, table, put, offset=offset)


def _draws_in_place(init, table) -> bool:
  """Whether the CPU kernel draws ``init``'s rows: the default ``HashedUniform``
  (not a subclass: it may change the values) into a float32 table."""
  return (type(init) is initializers.HashedUniform and table.dtype == jnp.float32
          and cpu_library.available())


def _place_hashed_uniform(init, key_data, table, put, *, offset):
  return dynamic_map_cpu.place_hashed_uniform_cpu(
      table, put, jnp.stack(initializers.key_words(key_data)), offset,
      step=init.step(table.shape[1]))


def _place_rows_xla(init, key_data, table, put, *, offset):
  # A step that places only rows never placed before (a table not yet
  # full) draws nothing: it skips the packing too.
  return lax.cond(jnp.any(put < table.shape[0]),
                  functools.partial(_draw_rows, init, key_data, put=put, offset=offset),
                  lambda t: t, table)


def _draw_rows(init, key_data, table, *, put, offset):
  n, m = table.shape[0], put.shape[0]
  count = jnp.sum(put < n)
  (where,) = jnp.nonzero(put < n, size=m, fill_value=0)
  rows = jnp.where(jnp.arange(m) < count, put[where], n)     # placed rows first
  chunk = place_chunk(m)
  rows = jnp.concatenate([rows, jnp.full((-m % chunk,), n, rows.dtype)])
  xla = lambda t, r, v: t.at[r].set(v, mode="drop")
  set_rows = xla
  if cpu_library.available():
    set_rows = lambda t, r, v: platforms.by_platform(
        t, r, v, cpu=dynamic_map_cpu.set_rows_cpu, gpu=xla, default=xla)

  def place(i, t):
    r = lax.dynamic_slice(rows, (i * chunk,), (chunk,))
    at = jnp.minimum(r, n - 1) + offset
    return set_rows(t, r, init_rows(init, key_data, at, t.shape[1], t.dtype))

  return lax.fori_loop(0, (count + chunk - 1) // chunk, place, table)


@functools.partial(jax.jit, static_argnames=("init", "shape", "dtype"))
def initial_table(init, key, shape, dtype):
  """Every row's initial value, ``init_rows`` of rows ``0 .. shape[0] - 1``: a
  ``DynamicEmbed``'s table as it is created (``ShardedEmbed``'s initializer).

  The same on any device count, and the values a step gives a row it
  places again (``_place_rows``), bit for bit with the default
  ``HashedUniform``, whose values are exact. Another initializer's float
  transform is rounded as the program that runs it rounds: this one is
  compiled (never run one primitive at a time, as ``nnx.Embed``'s eager
  draw is) with XLA's default passes, as a step is; jax 0.10's XLA:CPU
  folds a normal draw's two scales into one constant there (see
  ``_compat.init_compiler_options``). On jax >= 0.11 XLA:CPU may still
  round the tail of a vectorized loop differently in the two programs, an
  ulp or two on a few entries.

  >>> from flax.nnx.nn.linear import default_embed_init
  >>> key = jax.random.key(0)
  >>> table = initial_table(default_embed_init, key, (6, 3), jnp.float32)
  >>> place = jax.jit(init_rows, static_argnums=(0, 3, 4))
  >>> rows = place(default_embed_init, jax.random.key_data(key), jnp.array([4]), 3, jnp.float32)
  >>> bool(jnp.array_equal(table[4], rows[0]))
  True
  """
  rows = jnp.arange(shape[0], dtype=jnp.int32)
  return init_rows(init, jax.random.key_data(key), rows, shape[1], dtype)


def init_rows(init, key_data, rows, features, dtype):
  """Each row's initial value: ``init`` drawn with the key folded with its row number.

  A row initializer (``initializers.HashedUniform``, the default) draws the
  rows by number itself. Any other ``init`` is drawn with the key
  ``jax.random.wrap_key_data(key_data)`` folded with each row's number; with
  jax's default (partitionable threefry) it is drawn through
  ``draws.UNROLLED``, the same bits with the hash unrolled, which XLA:CPU
  fuses with the values' math.
  """
  if initializers.is_row_init(init):
    return init.rows(key_data, rows, features, dtype)
  key = jax.random.wrap_key_data(key_data, impl=draws.impl_for(key_data))
  draw = lambda r: init(jax.random.fold_in(key, r), (1, features), dtype)[0]
  return jax.vmap(draw)(rows)


def route_capacity(ids_per_rank: int, group: int, capacity: int | None) -> int:
  """Ids one rank sends each owner in a step: twice the even share, or as given.

  >>> route_capacity(1024, 8, None), route_capacity(4, 8, None), route_capacity(64, 8, 3)
  (256, 4, 3)
  """
  if capacity is not None:
    return max(1, min(capacity, ids_per_rank))
  return min(ids_per_rank, max(8, -(-2 * ids_per_rank // group)))


def _route(flat, policy, group, cap):
  """This rank's ids in a ``[group * cap, 2]`` send buffer by owner; each id's slot."""
  hi, lo = flat[:, 0], flat[:, 1]
  pad = (hi == jnp.uint32(ids_lib.PAD_WORD)) & (lo == jnp.uint32(ids_lib.PAD_WORD))
  owner = ids_lib.bucket_of(hi, lo, policy.num_buckets) // (policy.num_buckets // group)
  _, slot, need = unique_lib.bucketize(jnp.where(pad, -1, owner), 1, group, cap)
  put = jnp.where(slot >= 0, slot, group * cap)
  send = jnp.full((group * cap, 2), ids_lib.PAD_WORD, jnp.uint32).at[put].set(flat, mode="drop")
  return send, slot, need


@functools.partial(jax.jit, static_argnames=("policy", "mesh", "table_axes", "train", "init",
                                             "table_spec", "capacity"))
def run(state: step_lib.MapState, placed_at, table, key_data, clock, flat, *,
        policy: policy_lib.Policy, mesh, table_axes: tuple, train: bool, init, table_spec,
        capacity: int | None = None):
  """The map's step (or look-up) for ``flat`` uint32 ``[m, 2]`` id words.

  Args:
    state: the whole table's ``MapState``, split over ``table_axes``.
    placed_at: int32 ``[capacity]``, the clock at which each row was placed
      (``NEVER_PLACED``: not yet).
    table: the rows, ``[capacity, features]`` laid out by ``table_spec``; None
      leaves the rows alone (a pipelined step places them later: ``place``).
    key_data: the init key's data.
    clock: int32 scalar, before this step.
    flat: uint32 ``[m, 2]`` id words.
    capacity: ids one rank routes to each owner (``route_capacity``).

  Returns:
    ``(state, placed_at, table, rows, stats)``: rows int32 ``[m]`` (global
    row, ``-1``: the default), stats int32 ``[5]`` (resident rows, admitted,
    evicted, lookups reading the default, lookups), summed over the group.
  """
  kw = dict(policy=policy, train=train, init=init)
  if mesh is None:
    state, (placed_at, table), rows, stats = _local(
        state, (placed_at, table, key_data), clock, flat, index=0, group=1, **kw)
    return state, placed_at, table, rows, stats
  group = math.prod(dict(mesh.shape)[a] for a in table_axes)
  split = P(table_axes or None)
  given = getattr(jax.typeof(flat), "sharding", None)
  batch_spec = P(given.spec[0]) if given is not None and given.spec else P()
  m = flat.shape[0]
  # Each rank of the group holds a share of the ids and routes them to their
  # owners; a batch that doesn't split evenly over the group goes whole to
  # every rank instead.
  routed = bool(table_axes) and group > 1 and m % group == 0
  cap = route_capacity(m // group, group, capacity) if routed else 0
  id_spec = P(table_axes) if routed else P()
  flat = sharding_lib.place(flat, mesh, id_spec)
  state = step_lib.MapState(*(None if v is None else sharding_lib.place(v, mesh, split)
                              for v in state))
  placed_at = sharding_lib.place(placed_at, mesh, split)
  has_table = table is not None
  table = (sharding_lib.place(table, mesh, P(*table_spec)) if has_table
           else jnp.zeros((1,), jnp.float32))
  key_data, clock = (sharding_lib.place(v, mesh, P()) for v in (key_data, clock))
  has_sketch = state.sketch is not None

  def body(khi, klo, score, sketch, placed_at, table, key_data, clock, flat):
    index = lax.axis_index(table_axes) if table_axes else 0
    local = step_lib.MapState(khi, klo, score, sketch if has_sketch else None)
    extra = (placed_at, table if has_table else None, key_data)
    run_local = functools.partial(_local, index=index, group=group, **kw)

    def gathered():
      every = lax.all_gather(flat, table_axes, tiled=True) if routed else flat
      local2, (placed_at2, table2), rows, stats = run_local(local, extra, clock, every)
      if table_axes:
        rows = lax.psum(rows + 1, table_axes) - 1
        stats = lax.psum(stats, table_axes)
      if routed:
        rows = lax.dynamic_slice_in_dim(rows, index * flat.shape[0], flat.shape[0])
      return local2, placed_at2, table2, rows, stats

    if routed:
      send, slot, need = _route(flat, policy, group, cap)
      need = lax.pmax(need, table_axes)

      def owners():
        asked = lax.all_to_all(send, table_axes, 0, 0, tiled=True)
        local2, (placed_at2, table2), rows, stats = run_local(local, extra, clock, asked)
        back = lax.all_to_all(rows, table_axes, 0, 0, tiled=True)
        rows = jnp.where(slot >= 0, back[jnp.maximum(slot, 0)], -1)
        return local2, placed_at2, table2, rows, lax.psum(stats, table_axes)

      local, placed_at, table, rows, stats = lax.cond(need <= cap, owners, gathered)
    else:
      local, placed_at, table, rows, stats = gathered()
    sketch = local.sketch if has_sketch else sketch
    table = table if has_table else jnp.zeros((1,), jnp.float32)
    return local.keys_hi, local.keys_lo, local.score, sketch, placed_at, table, rows, stats

  sketch = state.sketch if has_sketch else jnp.zeros((1,), jnp.uint8)
  sspec = split if has_sketch else P()
  tspec = P(*table_spec) if has_table else P()
  khi, klo, score, sketch, placed_at, table, rows, stats = jax.shard_map(
      body, mesh=mesh,
      in_specs=(split, split, split, sspec, split, tspec, P(), P(), id_spec),
      out_specs=(split, split, split, sspec, split, tspec, id_spec, P()),
      check_vma=False,
  )(state.keys_hi, state.keys_lo, state.score, sketch, placed_at, table, key_data, clock, flat)
  state = step_lib.MapState(khi, klo, score, sketch if has_sketch else None)
  table = table if has_table else None
  # Rows leave split as the ids came, so the lookup stays data-parallel.
  return state, placed_at, table, sharding_lib.place(rows, mesh, batch_spec), stats


@functools.partial(jax.jit, static_argnames=("mesh", "table_axes", "init", "table_spec", "bound"))
def place(table, placed_at, before, clock, key_data, *, mesh, table_axes: tuple, init,
          table_spec, bound: int):
  """``table`` with every row placed at ``clock`` set to its initial value.

  What ``run`` does to the rows it places, done apart: a pipelined step
  runs the map a step ahead (``run`` with no table) and places the rows in
  the step that looks them up, after the previous step's update, as the
  in-line step does. The values are ``init_rows``', the same bit for bit,
  and a row placed for the first time (``before`` is ``NEVER_PLACED``) is
  left as it is, as ``run`` leaves it.

  Args:
    table: the rows, ``[capacity, features]`` laid out by ``table_spec``.
    placed_at: int32 ``[capacity]``, as ``run`` returned it.
    before: int32 ``[capacity]``, ``placed_at`` before that step.
    clock: int32 scalar, the clock after the step that placed them.
    key_data: the init key's data.
    bound: at most this many rows were placed (the step's ids).
  """
  def body(table, placed_at, before, key_data, clock, index):
    n = placed_at.shape[0]
    drawn = (placed_at == clock) & (before != NEVER_PLACED)
    (put,) = jnp.nonzero(drawn, size=max(1, min(n, bound)), fill_value=n)
    return _place_rows(init, key_data, table, put.astype(jnp.int32), index * n)

  if mesh is None:
    return body(table, placed_at, before, key_data, clock, 0)
  split, tspec = P(table_axes or None), P(*table_spec)
  table = sharding_lib.place(table, mesh, tspec)
  placed_at, before = (sharding_lib.place(v, mesh, split) for v in (placed_at, before))
  key_data, clock = (sharding_lib.place(v, mesh, P()) for v in (key_data, clock))
  return jax.shard_map(
      lambda *a: body(*a, lax.axis_index(table_axes) if table_axes else 0), mesh=mesh,
      in_specs=(tspec, split, split, P(), P()), out_specs=tspec, check_vma=False,
  )(table, placed_at, before, key_data, clock)
