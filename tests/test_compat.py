"""``embedlib._compat``: the writes of a traced step."""

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib import _compat


def test_assign_writes_as_flax_does_without_asking_a_tracer_for_its_sharding(monkeypatch):
  asked = []
  sharding = jax.core.Tracer.sharding
  monkeypatch.setattr(jax.core.Tracer, "sharding",
                      property(lambda t: asked.append(t) or sharding.fget(t)))

  def step(x):
    same, spread = nnx.Variable(jnp.zeros(3)), nnx.Variable(jnp.zeros(3))
    _compat.assign(same, x + 1)   # a traced value of the variable's shape and dtype
    asked_before = len(asked)
    _compat.assign(spread, x.sum())  # another shape: flax's [...] = writes it in
    return same[...], spread[...], asked_before

  same, spread, asked_before = jax.jit(step)(jnp.arange(3.0))
  assert asked_before == 0
  assert same.tolist() == [1.0, 2.0, 3.0] and spread.tolist() == [3.0, 3.0, 3.0]

  concrete = nnx.Variable(jnp.zeros(2))
  _compat.assign(concrete, jnp.ones(2))
  assert concrete[...].tolist() == [1.0, 1.0]
