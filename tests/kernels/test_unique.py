"""The C++ distinct ids (``kernels.unique_cpu``) against the sort (``strategies.unique.unique_sorted``).

Both must return the same three arrays, bit for bit: the distinct ids in
increasing order, each id's index among them and their count, also when the
count overflows the capacity. The ids cover both ways of the kernel: a
range within a few times their number (marks) and a far wider one (a hash
table), with repeats, padding, every id padding and ``2**31 - 1`` (invalid: the
sort's key for "none").
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from embedlib import axes
from embedlib.kernels.unique_cpu import unique_cpu
from embedlib.strategies import unique as unique_lib

from ..cpu_kernels import require_cpu_kernels

CASES = {  # name -> (ids, capacity)
    "marks": (np.array([7, 3, 7, -1, 3, 9, 0, 0], np.int32), 8),
    "marks, overflow": (np.array([7, 3, 7, -1, 3, 9, 0, 0], np.int32), 2),
    "hash": (np.array([2**31 - 2, 5, -1, 123_456_789, 5, 2**31 - 2, 2**31 - 1], np.int32), 6),
    "hash, overflow": (np.array([2**31 - 1, 5, -1, 123_456_789, 5, 70_000], np.int32), 3),
    "all padding": (np.full((5,), -1, np.int32), 4),
    "random marks": (np.random.default_rng(0).integers(-3, 300, 2_000).astype(np.int32), 256),
    "random hash": (np.random.default_rng(1).integers(-3, 2**31 - 1, 2_000).astype(np.int32), 2_000),
}


@pytest.fixture(scope="module")
def kernels_built():
  require_cpu_kernels()


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_kernel_equals_the_sort(kernels_built, name):
  ids, capacity = CASES[name]
  got = jax.jit(unique_cpu, static_argnums=1)(jnp.asarray(ids), capacity)
  want = jax.jit(unique_lib.unique_sorted, static_argnums=1)(jnp.asarray(ids), capacity)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  # Against numpy too: a wrong sort would agree with a wrong kernel.
  valid = (ids >= 0) & (ids != 2**31 - 1)  # the sort's key for "none"
  distinct = np.unique(ids[valid])
  assert int(got[2]) == distinct.size
  kept = min(capacity, distinct.size)
  np.testing.assert_array_equal(np.asarray(got[0])[:kept], distinct[:kept])
  np.testing.assert_array_equal(np.asarray(got[0])[kept:], -1)
  inverse = np.asarray(got[1])
  np.testing.assert_array_equal(inverse[~valid], -1)
  np.testing.assert_array_equal(inverse[valid], np.searchsorted(distinct, ids[valid]))


def test_unique_with_inverse_per_shard_and_vmapped(kernels_built):
  """In ``shard_map`` (results typed per shard) and under ``vmap`` (one call per row)."""
  ids = np.random.default_rng(2).integers(-1, 50, (8, 12)).astype(np.int32)
  mesh = jax.make_mesh((8,), (axes.BATCH,))
  per_shard = jax.jit(jax.shard_map(
      lambda x: jax.tree.map(lambda a: a[None], unique_lib.unique_with_inverse(x, 16)),
      mesh=mesh, in_specs=P(axes.BATCH), out_specs=P(axes.BATCH)))
  mapped = jax.jit(jax.vmap(lambda x: unique_lib.unique_sorted(x, 16)))
  sharded = jax.device_put(ids, jax.NamedSharding(mesh, P(axes.BATCH)))
  for got, want in zip(per_shard(sharded), mapped(jnp.asarray(ids))):
    np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), np.asarray(want))
