"""Feature inputs in their three forms, brought to one: padded ``[batch, bag]`` bags.

A feature's ids arrive as ``[batch]`` (single-hot), ``[batch, bag]`` padded
with ``-1``, or ragged ``(values, lengths)`` with a static capacity; weights,
when given, have the shape of the ids (``[capacity]`` for ragged ids). Every
form becomes ``ids [batch, bag]`` int32 with ``-1`` at padding and at every
invalid id, plus aligned weights or None (``to_bags``). A dynamic table's
raw ids are taken as they come, ``[batch]`` or padded ``[batch, bag]``
(``raw_request``). Shape errors name the feature, and are checked here
once for both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from embedlib import invalid_ids as invalid_lib
from embedlib import kernels
from embedlib import sharding as sharding_lib
from embedlib.collection.specs import FeatureSpec, Ragged
from embedlib.dynamic import ids as dynamic_ids
from embedlib.strategies.request import Request


@dataclasses.dataclass(frozen=True)
class Bags:
  """One feature's ids as padded bags.

  Attributes:
    ids: int32 ``[batch, bag]``, ``-1`` for padding and invalid ids.
    weights: float ``[batch, bag]`` or None.
    single_hot: the input was ``[batch]``: the output drops the bag axis.
  """

  ids: object
  weights: object
  single_hot: bool

  @property
  def batch(self) -> int:
    return self.ids.shape[0]


def _ragged_parts(x):
  if isinstance(x, Ragged):
    return x.values, x.lengths
  if isinstance(x, tuple) and len(x) == 2:
    return x
  return None


def _check_sequence_weights(spec: FeatureSpec, weights, owner: str) -> None:
  if spec.is_sequence and weights is not None:
    raise ValueError(
        f"{owner}: weights were given for a sequence feature (combiner=None), "
        f"whose rows are returned unpooled; drop the weights or set a combiner."
    )


def _check_ids_shape(spec: FeatureSpec, shape: tuple, owner: str) -> None:
  """``[batch]`` or ``[batch, bag]`` ids, bags no wider than ``max_ids_per_sample``."""
  if len(shape) not in (1, 2):
    raise ValueError(
        f"{owner}: ids must be [batch], [batch, bag] or (values, lengths), "
        f"got shape {shape}."
    )
  limit = spec.max_ids_per_sample
  if len(shape) == 2 and limit is not None and shape[1] > limit:
    kind = "single-hot" if limit == 1 else "limited"
    raise ValueError(
        f"{owner} is {kind} (max_ids_per_sample={limit}) but got a bag input "
        f"of shape {shape}; pass [batch] ids"
        + ("" if limit == 1 else f" or [batch, <={limit}] bags")
        + f", or raise FeatureSpec({spec.name!r}, ..., max_ids_per_sample=)."
    )


def raw_request(spec: FeatureSpec, ids, weights) -> Request:
  """A feature of a dynamic table: its raw ids as a ``DynamicEmbed`` ``Request``.

  Ids stay as given (host integers of any dtype, exact; 32-bit device ids;
  ``Words``): ``[batch]`` or ``[batch, bag]`` padded with ``-1``, not
  ragged. A pooled ``[batch]`` feature is a bag of one.
  """
  owner = f"feature {spec.name!r}"
  if _ragged_parts(ids) is not None:
    raise ValueError(
        f"{owner} reads dynamic table {spec.table!r}, which takes padded ids ([batch] or "
        "[batch, bag] padded with -1), not ragged ones; pad the bags.")
  if not isinstance(ids, (dynamic_ids.Words, jax.Array)):
    ids = np.asarray(ids)  # host ids stay exact: DynamicEmbed splits them into words
  _check_ids_shape(spec, tuple(ids.shape), owner)
  _check_sequence_weights(spec, weights, owner)
  if spec.is_sequence:
    return Request(ids)
  if len(ids.shape) == 1:  # single-hot: a bag of one
    ids = ids[:, None] if not isinstance(ids, dynamic_ids.Words) else dynamic_ids.Words(
        ids.value[:, None])
    weights = None if weights is None else weights[:, None]
  return Request(ids, weights, spec.combiner)


def to_bags(spec: FeatureSpec, x, weights, num_embeddings: int) -> Bags:
  """Normalises one feature's input (see the module docstring).

  Args:
    spec: the feature.
    x: ``[batch]`` or ``[batch, bag]`` int ids, or a ``Ragged`` /
      ``(values, lengths)`` pair.
    weights: None, or float weights shaped like the ids (``[capacity]`` for
      ragged ids).
    num_embeddings: rows of the feature's table, for the invalid-id rule.

  Returns:
    ``Bags``.

  >>> import jax.numpy as jnp
  >>> b = to_bags(FeatureSpec("f", "t", max_ids_per_sample=2),
  ...             (jnp.array([3, 4, 9]), jnp.array([1, 2])), None, 5)
  >>> b.ids.tolist(), b.single_hot
  ([[3, -1], [4, -1]], False)
  """
  owner = f"feature {spec.name!r}"
  _check_sequence_weights(spec, weights, owner)
  ragged = _ragged_parts(x)
  single = False
  if ragged is not None:
    # Sanitised before padding: a -1 pad in a narrow unsigned dtype would
    # wrap onto a valid row.
    values = invalid_lib.as_ids(ragged[0], num_embeddings)
    if jnp.issubdtype(values.dtype, jnp.integer):
      values = invalid_lib.sanitize(values, num_embeddings)
    # Read across the whole batch (offsets are a cumsum of the lengths): a
    # split over Explicit mesh axes would be refused by JAX.
    values = sharding_lib.unsplit(values)
    lengths = sharding_lib.unsplit(jnp.asarray(ragged[1]))
    if weights is not None:
      weights = sharding_lib.unsplit(jnp.asarray(weights))
    if spec.max_ids_per_sample is None:
      raise ValueError(
          f"{owner}: ragged ids need a static bag width; set "
          f"FeatureSpec({spec.name!r}, ..., max_ids_per_sample=N)."
      )
    if values.ndim != 1 or lengths.ndim != 1:
      raise ValueError(
          f"{owner}: ragged ids need values [capacity] and lengths [batch], got "
          f"shapes {values.shape} and {lengths.shape}."
      )
    if weights is not None and jnp.shape(weights) != values.shape:
      raise ValueError(
          f"{owner}: ragged weights must be shaped like values {values.shape}, "
          f"got {jnp.shape(weights)}."
      )
    try:
      padded = kernels.ragged_to_padded(
          values, lengths, spec.max_ids_per_sample, weights
      )
    except ValueError as e:
      if not str(e).startswith("ragged_to_padded:"):
        raise  # not a message of ours: never pass JAX's errors off as the feature's
      raise ValueError(f"{owner}: {e}") from None
    ids, weights = padded if weights is not None else (padded, None)
  else:
    ids = invalid_lib.as_ids(x, num_embeddings)
    _check_ids_shape(spec, ids.shape, owner)
    if ids.ndim == 1:
      single = True
      ids = ids[:, None]
      if weights is not None:
        weights = jnp.asarray(weights)
        weights = weights[:, None] if weights.ndim == 1 else weights
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{owner}: ids must be integers, got {ids.dtype}.")
  if weights is not None:
    weights = jnp.asarray(weights)
    Request(ids, weights, spec.combiner).check_bag(owner, ids.shape)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
      weights = weights.astype(jnp.float32)
  return Bags(invalid_lib.sanitize(ids, num_embeddings), weights, single)
