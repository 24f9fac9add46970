"""Version switches between the supported jax / flax releases, in one place.

Supported: Python 3.11 with jax 0.10.x / flax 0.12.8, and Python 3.12 with
jax >= 0.11 / flax >= 0.12.9. Everything that differs between them is
resolved here so the rest of the library imports one name.
"""

from __future__ import annotations

import jax
from jax import sharding as _sharding

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

shard_map = jax.shard_map
AbstractMesh = _sharding.AbstractMesh
Mesh = _sharding.Mesh
AxisType = _sharding.AxisType
reshard = _sharding.reshard
use_abstract_mesh = _sharding.use_abstract_mesh
auto_axes = _sharding.auto_axes


def init_compiler_options(platform: str) -> dict:
  """XLA options for the jitted program that draws a table (``embedlib.table``).

  nnx.Embed draws its table eagerly, one primitive at a time. Compiled as one
  program, jax 0.10's XLA:CPU algebraic simplifier folds an initializer's
  scale into ``jax.random.normal``'s own constant (``x * c1 * c2`` becomes
  ``x * (c1 * c2)``), which rounds the last bit of most entries differently
  for most widths with ``default_embed_init``. Without that pass the program
  gives the eager values bit for bit. Newer XLA doesn't fold them, and other
  platforms keep their default pipeline.
  """
  if JAX_VERSION < (0, 11) and platform == "cpu":
    return {"xla_disable_hlo_passes": "algsimp"}
  return {}


def _opt_state_code():
  """The code of flax's ``to_opt_state`` leaf function, which builds ``nnx.Optimizer``'s slots.

  It builds each slot as ``OptVariable(x.get_value(), **x.get_metadata())``
  from a copy of the parameter holding optax's slot, in every supported
  flax (0.12.8 to 0.12.12); None if a flax builds them otherwise.
  """
  try:
    from flax.nnx.training import optimizer  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  code = getattr(getattr(optimizer, "to_opt_state", None), "__code__", None)
  consts = () if code is None else code.co_consts
  return next((c for c in consts if getattr(c, "co_name", None) == "_to_opt_state"), None)


_OPT_STATE_CODE = _opt_state_code()


def building_opt_state(frame) -> bool:
  """Whether ``frame`` (a ``get_value`` caller) is flax building an optimizer slot."""
  return _OPT_STATE_CODE is not None and frame.f_code is _OPT_STATE_CODE


def assign(variable, value) -> None:
  """``variable[...] = value``, for the whole-value writes of a traced step.

  Flax's ``[...] =`` replaces the value where the new one has the old one's
  shape, dtype and sharding, and writes it in otherwise. Under a trace both
  are tracers, which have no sharding, so it replaces them; but jax 0.10
  builds the error message of each missing ``sharding`` first, and that
  walks the whole program traced so far. In a train step that writes many
  variables (a dynamic table's map, clock and slots, the optimizer's slots)
  the writes then cost time that grows with the square of the step's size.
  A traced value of the same shape and dtype is the same replacement made
  directly; any other write goes through ``[...] =``.
  """
  raw = variable.get_raw_value()
  if (isinstance(value, jax.core.Tracer) and isinstance(raw, jax.core.Tracer)
      and value.shape == raw.shape and value.dtype == raw.dtype):
    variable.set_value(value)
  else:
    variable[...] = value
