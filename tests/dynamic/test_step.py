"""One shard's vectorised step equals the dict-per-bucket reference exactly.

Random ids (64-bit ones and padding included) under every policy; the
examples are few and derandomized in CI (``EMBEDLIB_HYPOTHESIS_EXAMPLES=N``
draws ``N`` new ones per policy).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedlib.dynamic import ids as ids_lib
from embedlib.dynamic import policy as policy_lib
from embedlib.dynamic import reference as ref_lib
from embedlib.dynamic import step as step_lib
from tests.dynamic import helpers

DEEP = int(os.environ.get("EMBEDLIB_HYPOTHESIS_EXAMPLES", "0"))
POLICIES = [
    dict(eviction="lru"),
    dict(eviction="lfu", decay_every=3),
    dict(eviction=None),
    dict(eviction="lru", admit_after=2, sketch_width=3, decay_every=4),
    dict(eviction="lfu", admit_after=3, sketch_width=2),
]


@pytest.fixture(scope="module", params=range(len(POLICIES)), ids=lambda i: str(POLICIES[i]))
def compiled(request):
  policy = policy_lib.Policy(16, bucket_size=4, **POLICIES[request.param])

  @jax.jit
  def run(state, flat, clock):
    hi, lo = flat[:, 0], flat[:, 1]
    pad = (hi == jnp.uint32(ids_lib.PAD_WORD)) & (lo == jnp.uint32(ids_lib.PAD_WORD))
    bucket = ids_lib.bucket_of(hi, lo, policy.num_buckets)
    return step_lib.admit_step(state, hi, lo, ~pad, bucket, clock, policy=policy)

  return policy, run


@settings(max_examples=DEEP or 2, deadline=None, derandomize=not DEEP, database=None,
          suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1))
def test_step_equals_reference(compiled, seed):
  policy, run = compiled
  ref = ref_lib.Reference(policy)
  state = helpers.empty_state(policy)
  for t, batch in enumerate(helpers.draw_batches(seed, 8, 12)):
    flat = jnp.asarray(ids_lib.host_words(batch))
    state, rows, placed, stats = run(state, flat, jnp.int32(t))
    want, want_placed = ref.step(ref_lib.as_uint64(batch))
    assert np.asarray(rows).tolist() == want, (t, batch)
    got_placed = sorted(set(np.asarray(rows)[np.asarray(placed)].tolist()))
    assert got_placed == sorted(want_placed)
    occupancy, admitted, evicted, defaults = np.asarray(stats).tolist()
    assert (admitted, evicted) == (ref.stats["admitted"], ref.stats["evicted"])
    assert occupancy == round(ref.stats["occupancy"] * policy.capacity)
    valid = sum(1 for i in ref_lib.as_uint64(batch) if i != ref_lib.PAD)
    assert defaults == round(ref.stats["default_share"] * max(valid, 1))
  # Collision-free: distinct resident ids hold distinct rows.
  resident = ref.resident()
  assert len(set(resident.values())) == len(resident)


def test_order_of_arrival_does_not_matter(compiled):
  policy, run = compiled
  batch = helpers.draw_batches(7, 1, 16)[0]
  outs = []
  for perm in (np.arange(16), np.random.default_rng(0).permutation(16)):
    state = helpers.empty_state(policy)
    for t in range(3):
      flat = jnp.asarray(ids_lib.host_words(batch[perm], id_dtype="int64"))
      state, rows, _, _ = run(state, flat, jnp.int32(t))
    outs.append(dict(zip(batch[perm].tolist(), np.asarray(rows).tolist())))
  assert outs[0] == outs[1]


def test_late_clocks_take_the_exact_search(compiled):
  """Clocks past 2**24 no longer fit the packed victims' sort: the search must agree."""
  policy, run = compiled
  start = 2**30
  ref = ref_lib.Reference(policy)
  ref.clock = start
  state = helpers.empty_state(policy)
  for t, batch in enumerate(helpers.draw_batches(21, 6, 12)):
    flat = jnp.asarray(ids_lib.host_words(batch))
    state, rows, _, _ = run(state, flat, jnp.int32(start + t))
    assert np.asarray(rows).tolist() == ref.step(ref_lib.as_uint64(batch))[0], t


def test_many_buckets_split_over_threads_equal_the_reference():
  """Enough distinct ids that the CPU kernel steps its buckets on several threads.

  LFU with admission, decay and eviction: 1,024 buckets of 8 slots, and
  12,000 ids a step drawn from 30,000 with repeats, so buckets fill, admit
  and evict in every thread's range.
  """
  policy = policy_lib.Policy(8192, bucket_size=8, eviction="lfu", admit_after=2,
                             decay_every=2)
  run = jax.jit(lambda state, flat, clock: step_lib.admit_step(
      state, flat[:, 0], flat[:, 1], jnp.ones(flat.shape[0], bool),
      ids_lib.bucket_of(flat[:, 0], flat[:, 1], policy.num_buckets), clock, policy=policy))
  ref = ref_lib.Reference(policy)
  state = helpers.empty_state(policy)
  rng = np.random.default_rng(5)
  pool = rng.integers(1, 2**63, 30_000, dtype=np.int64)
  for t in range(4):
    hot = np.minimum(rng.zipf(1.2, 4_000) - 1, pool.size - 1)   # repeats, and uniform ids
    batch = pool[np.concatenate([hot, rng.integers(0, pool.size, 8_000)])]
    assert len(np.unique(batch)) > 4096   # two threads or more, where the CPUs allow
    state, rows, _, stats = run(state, jnp.asarray(ids_lib.host_words(batch)), jnp.int32(t))
    want, _ = ref.step(ref_lib.as_uint64(batch))
    assert np.asarray(rows).tolist() == want, t
    assert np.asarray(stats).tolist()[1:3] == [ref.stats["admitted"], ref.stats["evicted"]]
  assert ref.stats["evicted"] > 0
