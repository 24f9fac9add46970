"""The C++ map step (``kernels.dynamic_map_cpu``) against the XLA ops (``kernel="xla"``).

``dynamic.step.admit_step`` takes the kernel on CPU by default, and
``tests/dynamic/test_step.py`` holds that path to the plain-Python
reference; here both paths must return the same arrays bit for bit (the
state, every id's row, where ``placed`` is marked, the statistics) over
steps that fill buckets, evict, decay and count in the sketch, with ids
this shard does not own, and with clocks past the XLA path's packed sort;
and the eval lookup's rows after each step.
Inside ``shard_map`` (each device's buckets) the kernel runs in the layouts
of ``tests/dynamic``, which hold every layout to the reference.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embedlib.dynamic import ids as ids_lib
from embedlib.dynamic import initializers
from embedlib.dynamic import mapping
from embedlib.dynamic import policy as policy_lib
from embedlib.dynamic import step as step_lib
from embedlib.kernels import dynamic_map_cpu
from tests.dynamic import helpers

from ..cpu_kernels import require_cpu_kernels

POLICIES = [
    dict(eviction="lru"),
    dict(eviction="lfu", decay_every=2),
    dict(eviction=None),
    dict(eviction="lru", admit_after=2, sketch_width=3, decay_every=3),
    dict(eviction="lfu", admit_after=3, sketch_width=2, sketch_depth=3),
]


def _step(state, flat, clock, *, policy, kernel, owner):
  """The step of shard 0 of 2 (``owner``) or of the whole map."""
  hi, lo = flat[:, 0], flat[:, 1]
  pad = (hi == jnp.uint32(ids_lib.PAD_WORD)) & (lo == jnp.uint32(ids_lib.PAD_WORD))
  bucket = ids_lib.bucket_of(hi, lo, policy.num_buckets)
  own = ~pad
  if owner:
    half = policy.num_buckets // 2
    own = own & (bucket < half)
  if clock is None:
    return step_lib.lookup(state, hi, lo, own, bucket, bucket_size=policy.bucket_size,
                           kernel=kernel)
  return step_lib.admit_step(state, hi, lo, own, bucket, clock, policy=policy, kernel=kernel)


@pytest.fixture(scope="module", params=range(len(POLICIES)), ids=lambda i: str(POLICIES[i]))
def compiled(request):
  require_cpu_kernels()
  policy = policy_lib.Policy(16, bucket_size=4, **POLICIES[request.param])
  run = {k: jax.jit(functools.partial(_step, policy=policy, kernel=k), static_argnames="owner")
         for k in ("auto", "xla")}
  # The default takes the kernel on CPU (not a silent fall back to the XLA ops).
  args = (helpers.empty_state(policy), jnp.zeros((8, 2), jnp.uint32), jnp.int32(0))
  assert "embedlib_dynamic_map_step" in run["auto"].lower(*args, owner=False).as_text()
  assert "embedlib_dynamic_map_step" not in run["xla"].lower(*args, owner=False).as_text()
  return policy, run


def _equal(a, b, where):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=where)


# A bucket's ids in a step: a few with the helpers' 19 ids, 24 a step over 4
# buckets, sorted by insertion in the kernel; past its kInsertionSort (32)
# with 300 ids, 160 a step (about 40 a bucket), sorted by std::sort.
MANY_IDS = np.arange(300, dtype=np.int64) * 7919 - 2**40


@pytest.mark.parametrize("start,pool,size", [(0, helpers.POOL, 24), (2**30, helpers.POOL, 24),
                                             (0, MANY_IDS, 160)])
@pytest.mark.parametrize("owner", [False, True])
def test_kernel_equals_xla(compiled, start, pool, size, owner):
  policy, run = compiled
  states = {k: helpers.empty_state(policy) for k in run}
  for t, batch in enumerate(helpers.draw_batches(3 + start % 7, 7, size, pool)):
    flat = jnp.asarray(ids_lib.host_words(batch))
    outs = {k: run[k](states[k], flat, jnp.int32(start + t), owner=owner) for k in run}
    _equal(outs["auto"], outs["xla"], f"step {t}")
    states = {k: outs[k][0] for k in run}
    # The eval lookup of the next batch on the new map (no clock: a lookup).
    after = jnp.asarray(ids_lib.host_words(helpers.draw_batches(t, 1, 24)[0]))
    looked = {k: run[k](states[k], after, None, owner=owner) for k in run}
    _equal(looked["auto"], looked["xla"], f"lookup after step {t}")
  # Something happened: rows were placed and the map is not empty.
  assert int(np.sum(np.asarray(states["auto"].score) >= 0)) > 0


# The helpers' 19 ids over 16 rows, a few placed a step; and 2,048 rows in
# buckets of 16, each task placing more rows than the kernel holds pending
# (kPlacedAhead, 8), as the second of two shards: half the ids (and the
# padding) are not its own, and its rows start at 2,048.
@pytest.mark.parametrize("rows,pool,size,index,group", [(16, helpers.POOL, 24, 0, 1),
                                                        (2048, MANY_IDS, 160, 1, 2)],
                         ids=["small", "large"])
def test_step_and_place_equals_the_three_apart(compiled, rows, pool, size, index, group):
  """The map's step on the ids' words that also marks and draws the placed
  rows (one kernel, the default initializer on CPU) against the XLA ops
  apart: each id's bucket and owner, the step, the marking and the draws.
  The same state, marks, table, rows and statistics, bit for bit."""
  policy = dataclasses.replace(compiled[0], capacity=rows * group,
                               bucket_size=16 if rows > 16 else compiled[0].bucket_size)
  shard = dataclasses.replace(policy, capacity=rows)   # this shard's map
  init, key = initializers.HashedUniform(), jax.random.key_data(jax.random.key(3))
  never = mapping.NEVER_PLACED

  def together(state, placed_at, table, flat, clock):
    return mapping._step_and_place(state, placed_at, table, key, clock, flat, index, group,
                                   policy=policy, init=init)

  def apart(state, placed_at, table, flat, clock):
    hi, lo, own, bucket, rows_per = mapping._own(flat, policy, index, group)
    state, rows, placed, stats = step_lib.admit_step(state, hi, lo, own, bucket, clock,
                                                     policy=policy, kernel="xla")
    placed_at, drawn = mapping._mark_placed(placed_at, rows, placed, clock + 1)
    table = mapping._place_rows_xla(init, key, table, drawn, offset=index * rows_per)
    rows = jnp.where(rows >= 0, rows + index * rows_per, -1)
    return (state, placed_at, table, rows,
            jnp.concatenate([stats, jnp.sum(own, keepdims=True).astype(jnp.int32)]))

  rng = np.random.default_rng(index)
  n = rows
  # Half the rows never placed (their first placement draws nothing).
  placed_at = jnp.asarray(np.where(np.arange(n) % 2 == 0, never, 0), jnp.int32)
  table = jnp.asarray(rng.normal(size=(n, 5)), jnp.float32)
  run = {"together": jax.jit(together), "apart": jax.jit(apart)}
  args = (helpers.empty_state(shard), placed_at, table, jnp.zeros((8, 2), jnp.uint32),
          jnp.int32(0))
  lowered = run["together"].lower(*args).as_text()
  assert "embedlib_dynamic_map_step_place" in lowered
  assert "embedlib_mark_placed" not in lowered and "embedlib_place_hashed_uniform" not in lowered
  states = {k: (helpers.empty_state(shard), placed_at, table) for k in run}
  for t, batch in enumerate(helpers.draw_batches(5, 8, size, pool)):
    flat = jnp.asarray(ids_lib.host_words(batch))
    outs = {k: run[k](*states[k], flat, jnp.int32(t)) for k in run}
    _equal(outs["together"], outs["apart"], f"step {t}")
    states = {k: outs[k][:3] for k in run}
  # Some ids were another shard's, or padding (in the helpers' pool).
  assert int(outs["together"][4][4]) < size
  final = np.asarray(states["together"][2])
  redrawn = (np.asarray(states["together"][1]) > 0) & (np.arange(n) % 2 == 1)
  if policy.eviction is not None:   # rows were placed again, and drawn
    assert redrawn.any() and not np.array_equal(final[redrawn], np.asarray(table)[redrawn])


def test_step_and_place_updates_the_map_marks_and_table_in_place():
  """Donated, the one-pass step writes the map, the marks and the table where
  they are (XLA's memory analysis): no table-sized buffer besides them."""
  require_cpu_kernels()
  policy = policy_lib.Policy(1 << 14, bucket_size=128, eviction="lru")
  n, m, features = policy.capacity, 4096, 64
  init, key = initializers.HashedUniform(), jax.random.key_data(jax.random.key(0))

  def step(state, placed_at, table, flat, clock):
    return mapping._step_and_place(state, placed_at, table, key, clock, flat, 0, 1,
                                   policy=policy, init=init)

  shapes = (step_lib.MapState(*(jax.ShapeDtypeStruct((n,), d)
                                for d in (jnp.uint32, jnp.uint32, jnp.int32)), None),
            jax.ShapeDtypeStruct((n,), jnp.int32),
            jax.ShapeDtypeStruct((n, features), jnp.float32),
            jax.ShapeDtypeStruct((m, 2), jnp.uint32), jax.ShapeDtypeStruct((), jnp.int32))
  compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(*shapes).compile()
  assert "embedlib_dynamic_map_step_place" in compiled.as_text()
  memory = compiled.memory_analysis()
  # The three map arrays, the marks and the table: every byte aliased.
  assert memory.alias_size_in_bytes == 4 * n * 4 + n * features * 4
  # The step's own temporaries are a few [m] vectors, not a row of the table each.
  assert memory.temp_size_in_bytes < 16 * m * 4, memory.temp_size_in_bytes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_set_rows_equals_the_scatter(dtype):
  require_cpu_kernels()
  table = jnp.arange(40, dtype=jnp.float32).reshape(10, 4).astype(dtype)
  rows = jnp.array([3, 10, 0, -1, 9, 12], jnp.int32)          # 10, -1, 12: skipped
  values = -jnp.arange(24, dtype=jnp.float32).reshape(6, 4).astype(dtype) - 1
  got = jax.jit(dynamic_map_cpu.set_rows_cpu)(table, rows, values)
  want = table.at[rows].set(values, mode="drop")
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)))
  assert not np.array_equal(np.asarray(got.astype(jnp.float32)),
                            np.asarray(table.astype(jnp.float32)))


def test_mark_placed_equals_the_xla_ops():
  """The placed rows' marks and the rows placed again, kernel against the gather and scatter."""
  require_cpu_kernels()
  never = mapping.NEVER_PLACED
  placed_at = jnp.array([never, 3, never, 0, 5, never, 2, never, 1, never], jnp.int32)
  # Rows 0, 2 and 5 were never placed, 1 and 8 were; row 10 (past the end)
  # and every unplaced id are skipped.
  rows = jnp.array([1, 0, 4, 1, -1, 2, 10, 8, 5, 3, 6], jnp.int32)
  placed = jnp.array([1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0], bool)
  stamp = jnp.int32(7)
  got = jax.jit(functools.partial(dynamic_map_cpu.mark_placed_cpu, never=never))(
      placed_at, rows, placed, stamp)
  n = placed_at.shape[0]
  again = placed_at[jnp.clip(rows, 0, n - 1)] != never
  want = (placed_at.at[jnp.where(placed, rows, n)].set(stamp, mode="drop"),
          jnp.where(placed & again, rows, n))
  _equal(got, want, "mark placed")
  np.testing.assert_array_equal(np.asarray(got[1]), [1, n, n, n, n, n, n, 8, n, n, n])
  # The map's step takes the kernel on CPU.
  lowered = jax.jit(mapping._mark_placed).lower(placed_at, rows, placed, stamp).as_text()
  assert "embedlib_mark_placed" in lowered


# Ids whose low words repeat under 8 high words: in a bucket of 64 slots,
# residents whose low word matches an id's but whose high word does not, in
# the same 16 slots the kernel compares at once (kSlotsAMask) and before it.
SHARED_LOW_WORDS = (np.arange(8, dtype=np.int64)[:, None] * 2**32
                    + np.arange(600, dtype=np.int64) * 104729 + 3).reshape(-1)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("pool", [np.arange(5000, dtype=np.int64) * 104729 + 3,
                                  SHARED_LOW_WORDS], ids=["distinct", "shared_low_words"])
def test_kernel_equals_xla_when_a_bucket_evicts_many(eviction, pool):
  """Buckets of 64 slots, full after a step, then a few dozen evictions each a
  step: past the kernel's short list of victims (kFewVictims, 16), where it
  ranks them all; and the eval lookup of a batch after each step."""
  require_cpu_kernels()
  policy = policy_lib.Policy(128, bucket_size=64, eviction=eviction)
  run = {k: jax.jit(functools.partial(_step, policy=policy, kernel=k, owner=False))
         for k in ("auto", "xla")}
  states = {k: helpers.empty_state(policy) for k in run}
  evicted, found = [], []
  batches = helpers.draw_batches(11, 5, 400, pool)
  for t, batch in enumerate(batches[:-1]):
    flat = jnp.asarray(ids_lib.host_words(batch))
    outs = {k: run[k](states[k], flat, jnp.int32(t)) for k in run}
    _equal(outs["auto"], outs["xla"], f"step {t}")
    states = {k: outs[k][0] for k in run}
    evicted.append(int(outs["auto"][-1][2]))   # stats: resident, placed, evicted, defaults
    after = jnp.asarray(ids_lib.host_words(batches[t + 1]))
    looked = {k: run[k](states[k], after, None) for k in run}
    _equal(looked["auto"], looked["xla"], f"lookup after step {t}")
    found.append(int(np.sum(np.asarray(looked["auto"]) >= 0)))
  assert max(evicted) > 2 * 16, evicted     # more than one bucket's short list, twice over
  assert min(found) > 0, found              # the lookups found residents


def test_place_hashed_uniform_equals_the_xla_draws():
  """The default initializer's rows drawn into the table by the kernel, bit for
  bit as the packed, chunked XLA draws; a subclass or a bfloat16 table keeps
  the XLA draws."""
  require_cpu_kernels()
  key = jax.random.key_data(jax.random.key(7))
  rng = np.random.default_rng(0)
  for scale, shape, offset in ((1.0, (300, 64), 0), (0.37, (257, 33), 12345), (2.0, (96, 8), -5)):
    init = initializers.HashedUniform(scale)
    table = jnp.asarray(rng.normal(size=shape), jnp.float32)
    # Distinct rows, some past the end (skipped).
    put = jnp.asarray(rng.permutation(shape[0] + 40)[:120].astype(np.int32))
    place = jax.jit(lambda t, p, init=init, offset=offset: mapping._place_rows(
        init, key, t, p, offset))
    assert "embedlib_place_hashed_uniform" in place.lower(table, put).as_text()
    got = place(table, put)
    want = jax.jit(lambda t, p, init=init, offset=offset: mapping._place_rows_xla(
        init, key, t, p, offset=offset))(table, put)
    _equal(got, want, f"{shape}, offset {offset}")
    drawn = np.asarray(put)[np.asarray(put) < shape[0]]
    assert not np.array_equal(np.asarray(got)[drawn], np.asarray(table)[drawn])

  class Halved(initializers.HashedUniform):
    def rows(self, key_data, rows, features, dtype=jnp.float32):
      return super().rows(key_data, rows, features, dtype) / 2

  table, put = jnp.zeros((16, 8), jnp.float32), jnp.arange(4, dtype=jnp.int32)
  for init, t in ((Halved(), table), (initializers.HashedUniform(), table.astype(jnp.bfloat16))):
    lowered = jax.jit(lambda t, p, init=init: mapping._place_rows(init, key, t, p, 0)).lower(t, put)
    assert "embedlib_place_hashed_uniform" not in lowered.as_text()
