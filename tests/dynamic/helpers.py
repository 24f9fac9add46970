"""Shared pieces of the dynamic-table tests: id pools, meshes, the reference's table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from embedlib.dynamic import HashedUniform, init_rows
from embedlib.dynamic import step as step_lib

#: Raw ids: small ones, ones past 2**32 and 2**63, and padding (-1 as int64).
POOL = np.array([0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 2**32, 2**32 + 5, 2**33 + 1, 2**40 + 7,
                 2**62 + 11, 2**63 - 1, -(2**63), -2, -1], np.int64)


def empty_state(policy):
  """The map of ``policy`` with nothing resident: zero keys, score -1, an empty sketch."""
  n = policy.capacity
  sketch = (jnp.zeros((policy.num_buckets, policy.sketch_depth, policy.width), jnp.uint8)
            if policy.uses_sketch else None)
  return step_lib.MapState(jnp.zeros((n,), jnp.uint32), jnp.zeros((n,), jnp.uint32),
                           jnp.full((n,), -1, jnp.int32), sketch)


def mesh(n: int):
  return jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])


def draw_batches(seed: int, steps: int, size: int, pool=POOL) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.choice(pool, size) for _ in range(steps)]


#: ``init_rows`` compiled, as a table's creation and its steps draw (an eager
#: normal draw rounds its scale otherwise: ``mapping.initial_table``).
_init_rows = jax.jit(init_rows, static_argnums=(0, 3, 4))


class ReferenceTable:
  """The reference's rows: ``init_rows`` when created and when placed, plain SGD."""

  def __init__(self, capacity, features, key_data, init=HashedUniform()):
    self.key, self.init, self.features = key_data, init, features
    self.table = np.zeros((capacity, features), np.float32)
    self.place(list(range(capacity)))

  def place(self, rows):
    if rows:
      values = _init_rows(self.init, self.key, jnp.asarray(rows, jnp.int32), self.features,
                          jnp.float32)
      self.table[np.asarray(rows)] = np.asarray(values)

  def sgd(self, rows, cot, lr):
    grad = np.zeros_like(self.table)
    for r, c in zip(rows, cot):
      if r >= 0:
        grad[r] += c
    self.table = self.table - np.float32(lr) * grad
