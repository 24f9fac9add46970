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
