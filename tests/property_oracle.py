"""Pools, id strategies, numpy references and error recognition for the property tests.

Everything here is independent of embedlib's own code paths: the references
are numpy loops over Python integers (so no dtype can overflow or narrow an
id) computed in float64, and ``Outcome`` decides from the inputs alone
whether a call must return the reference answer or raise a documented error.

Pools are small on purpose: every new mesh, table size or input shape costs
an XLA compile, and drawing from a few values lets hypothesis examples reuse
the programs earlier ones compiled.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

# name -> (shape, axis names, extra ShardedEmbed / collection kwargs). The
# first entry of each pool is what hypothesis tries first and shrinks
# towards, so the pools open with their hardest case.
MESHES = {
    "8": ((8,), ("batch",), {}),  # token-sharded: data axes are the table axes
    "4x2": ((4, 2), ("data", "model"), {"table_axes": ("data", "model")}),  # token + rest
    "2x4": ((2, 4), ("data", "model"), {}),  # replicas x tensor-parallel
    "2": ((2,), ("model",), {}),  # tensor-parallel: ids replicated over the group
    "4": ((4,), ("batch",), {}),
    "1": ((1,), ("model",), {}),
    "none": None,
}
AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
#: 1 row; below int8 max; past int8/uint8; past int16, below uint16's max.
NUM_EMBEDDINGS = (37, 1, 300, 40_000)
#: 12 pads on 8 ranks, 1 and 3 on any group; 8 divides every group.
FEATURES = (12, 8, 1, 3)
STRATEGIES = ("vocab", "hidden", "auto", "replicated")
#: Numpy dtypes take every integer type; JAX arrays only those x64-off JAX holds.
NP_DTYPES = tuple(np.dtype(d) for d in (
    np.int32, np.int8, np.uint8, np.int16, np.uint16, np.uint32, np.int64, np.uint64))
JAX_DTYPES = NP_DTYPES[:6]
COMBINERS = ("sum", "mean", "sqrtn")


@functools.cache
def mesh(name: str, axis_type: str):
  if MESHES[name] is None:
    return None
  shape, names, _ = MESHES[name]
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(shape),
                       devices=jax.devices()[:n])


def mesh_kwargs(name: str) -> dict:
  return {} if MESHES[name] is None else dict(MESHES[name][2])


meshes = st.tuples(st.sampled_from(tuple(MESHES)), st.sampled_from(tuple(AXIS_TYPES)))


def _edges(n: int) -> list[int]:
  """Ids at the table's bounds and at every integer dtype's bounds."""
  return [n, -1, n - 1, n + 1, -2, 127, 128, 255, 256, 32_767, 32_768, 65_535, 65_536,
          2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 2**63 - 1, 2**63 + 3, -(2**31), -(2**63)]


def fits(v: int, dtype) -> bool:
  info = np.iinfo(dtype)
  return info.min <= v <= info.max


@st.composite
def id_values(draw, n: int, dtype, size: int, all_valid: bool) -> list[int]:
  """``size`` Python ints representable in ``dtype``: valid rows, or any edge id."""
  top = min(n - 1, np.iinfo(dtype).max)
  valid = st.integers(0, top)
  if all_valid:
    return draw(st.lists(valid, min_size=size, max_size=size))
  edges = [v for v in _edges(n) if fits(v, dtype)]
  return draw(st.lists(st.one_of(valid, st.sampled_from(edges)), min_size=size, max_size=size))


#: How ids reach embedlib: numpy (every dtype, the host path), a JAX array on
#: one device, or a JAX array already laid out on the mesh (split over its
#: data axes where the batch divides them).
CONTAINERS = ("numpy", "jax", "sharded")


@st.composite
def ids_array(draw, n: int, shape: tuple, container: str, all_valid=None):
  """``(host ids, the same ids as a Python-int object array)``; see ``as_container``."""
  dtypes = NP_DTYPES if container == "numpy" else JAX_DTYPES
  dtype = draw(st.sampled_from(dtypes))
  if all_valid is None:
    all_valid = draw(st.booleans())
  size = int(np.prod(shape))
  values = draw(id_values(n, dtype, size, all_valid))
  exact = np.array(values, dtype=object).reshape(shape)
  return np.array(values, dtype=dtype).reshape(shape), exact


def as_container(x: np.ndarray, container: str, mesh, data_axes):
  """``x`` as numpy, as a one-device JAX array, or laid out on ``mesh``."""
  if container == "numpy":
    return x
  if container == "jax" or mesh is None:
    return jnp.asarray(x)
  shards = int(np.prod([mesh.shape[a] for a in data_axes]))
  split = x.ndim and data_axes and x.shape[0] % shards == 0
  return jax.device_put(x, NamedSharding(mesh, P(tuple(data_axes)) if split else P()))


def weights(rng, shape) -> np.ndarray:
  """Per-id weights in [0.25, 2), about one in five zero (a bag may weigh nothing)."""
  w = rng.uniform(0.25, 2.0, shape).astype(np.float32)
  return np.where(rng.random(shape) < 0.2, np.float32(0), w)


def is_valid(exact, n: int):
  """Elementwise ``0 <= id < n`` on Python ints."""
  return np.vectorize(lambda v: 0 <= v < n, otypes=[bool])(exact)


def lookup(table: np.ndarray, exact) -> np.ndarray:
  """Rows of ``table`` (zeros for invalid ids), ``exact.shape + (features,)``."""
  n = table.shape[0]
  valid = is_valid(exact, n)
  index = np.where(valid, exact, 0).astype(np.int64)
  return np.where(valid[..., None], table[index], 0).astype(table.dtype)


def pooled(table: np.ndarray, exact, weights, combiner: str) -> np.ndarray:
  """TensorFlow-style pooling in float64: invalid ids are padding, 0/0 gives 0."""
  valid = is_valid(exact, table.shape[0])
  rows = lookup(table.astype(np.float64), exact)
  w = np.ones(exact.shape) if weights is None else np.asarray(weights, np.float64)
  w = np.where(valid, w, 0.0)
  total = np.einsum("bl,blf->bf", w, rows)
  if combiner == "sum":
    return total
  denom = w.sum(1) if combiner == "mean" else np.sqrt((w * w).sum(1))
  return np.where(denom[:, None] > 0, total / np.where(denom > 0, denom, 1.0)[:, None], 0.0)


def ragged_to_dense(values, lengths, width):
  """Ragged ``(values, lengths)`` as ``[batch, width]`` object ids padded with -1."""
  out = np.full((len(lengths), width), -1, dtype=object)
  start = 0
  for b, k in enumerate(lengths):
    kept = min(k, width)  # under jit an overlong bag is truncated (documented)
    out[b, :kept] = values[start:start + kept]
    start += k
  return out


def host(x) -> np.ndarray:
  return np.asarray(jax.device_get(x))


# -- outcomes ---------------------------------------------------------------

#: The documented error types; anything else (a raw XLA error, a JAX
#: sharding error, an AttributeError) is a bug whatever its message.
DOCUMENTED = (ValueError, IndexError, TypeError)


@dataclasses.dataclass
class Outcome:
  """What a call must do: return the reference, or raise one of ``errors``.

  ``errors`` holds ``(type, name)`` pairs: the call may raise an instance of
  ``type`` whose message names ``name`` (a table or feature: "ours" is
  recognised by the name, which only embedlib's own messages carry; JAX's
  errors never know it). Several pairs mean any of them is right (a call
  with two faults may report either first).
  """

  errors: list = dataclasses.field(default_factory=list)

  def expect(self, kind, name: str) -> None:
    self.errors.append((kind, name))


def call(outcome: Outcome, what: str, fn):
  """Runs ``fn()``: returns its result, or None when it raised as ``outcome`` allows.

  Fails when a valid call raises anything, when an invalid one returns, and
  when an error is not ours: not exactly ``ValueError`` / ``IndexError`` /
  ``TypeError`` (JAX's own errors subclass them) or not naming the thing.
  """
  expected = [(k.__name__, n) for k, n in outcome.errors]
  try:
    result = fn()
  except Exception as e:  # noqa: BLE001 - classifying every error is the point
    text = f"{type(e).__module__}.{type(e).__name__}: {e}"[:3000]
    if not outcome.errors:
      raise AssertionError(f"{what}: a valid call raised {text}") from e
    for kind, name in outcome.errors:
      if type(e) is kind and (repr(name) in str(e) or f"{name}:" in str(e)):
        return None
    raise AssertionError(f"{what}: expected one of {expected}, got {text}") from e
  if outcome.errors:
    raise AssertionError(f"{what}: expected one of {expected}, but the call returned")
  return result
