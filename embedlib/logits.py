"""Logits split over the vocabulary, as a tied output layer produces them.

``ShardedEmbed.attend(query, out_sharding=...)`` with an ``out_sharding``
that splits the last (vocabulary) dimension returns the logits split that
way. When the split divides ``num_embeddings`` that is a plain ``jax.Array``
of logical shape. When it doesn't (GPT-2's 50257 over 4 devices, 99 over 8),
no ``jax.Array`` can hold it: jax rejects a ``NamedSharding`` that doesn't
divide its dimension, for ``jit`` outputs too and on Auto as on Explicit
axes (checked on jax 0.10.2 and 0.12). Gathering the logits to fix the shape
would defeat the split, so the result is a ``VocabShardedLogits`` instead:
the logits padded, as the table is, to a multiple of the split, plus the
logical size. Its ``shape`` is the logical one; ``padded`` holds the blocks
each device owns; the padded columns are not logits and every consumer
(``vocab_parallel_cross_entropy``, ``unpadded()``) drops them.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import sharding as sharding_lib


@dataclasses.dataclass(frozen=True)
class VocabShardedLogits:
  """Logits ``[..., num_embeddings]`` stored padded and split over the vocabulary.

  A pytree (it passes through ``jit``, ``grad`` and ``nnx`` transforms) whose
  one array is ``padded``; ``num_embeddings``, ``mesh`` and ``spec`` are
  static. ``vocab_parallel_cross_entropy`` takes it as it is; anything else
  takes ``unpadded()``.

  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4])
  >>> padded = jnp.arange(8.0).reshape(1, 8)  # 7 logits padded to 8
  >>> logits = VocabShardedLogits(padded, 7, mesh, P(None, "model"))
  >>> logits.shape, logits.vocab_axes
  ((1, 7), ('model',))
  >>> logits.unpadded().tolist()
  [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]

  Attributes:
    padded: ``[..., padded_vocab]``, ``padded_vocab`` the first multiple of
      the vocabulary split at or past ``num_embeddings``; columns from
      ``num_embeddings`` on are padding, whatever their values.
    num_embeddings: the logical vocabulary size.
    mesh: the ``Mesh`` or ``AbstractMesh`` the logits are laid out on.
    spec: ``PartitionSpec`` of ``padded``, one entry per dimension; the last
      names the vocabulary axes.
  """

  padded: jax.Array
  num_embeddings: int
  mesh: tp.Any
  spec: P

  @property
  def vocab_axes(self) -> tuple[str, ...]:
    """Mesh axes the vocabulary is split over, in block order."""
    return axes_of(self.spec[-1])

  @property
  def shape(self) -> tuple[int, ...]:
    return self.padded.shape[:-1] + (self.num_embeddings,)

  @property
  def dtype(self):
    return self.padded.dtype

  @property
  def ndim(self) -> int:
    return self.padded.ndim

  @property
  def sharding(self) -> NamedSharding:
    """The sharding of ``padded``."""
    return NamedSharding(self.mesh, self.spec)

  def unpadded(self) -> jax.Array:
    """The logical ``[..., num_embeddings]`` logits, gathered over the vocabulary.

    Every device then holds all the logits of its tokens: what the split
    avoids. For a loss, pass the logits themselves to
    ``vocab_parallel_cross_entropy``.
    """
    whole = NamedSharding(self.mesh, P(*self.spec[:-1], None))
    return sharding_lib.place_always(self.padded, whole)[..., : self.num_embeddings]


jax.tree_util.register_dataclass(
    VocabShardedLogits,
    data_fields=["padded"],
    meta_fields=["num_embeddings", "mesh", "spec"],
)


def axes_of(entry) -> tuple[str, ...]:
  """A ``PartitionSpec`` entry as a tuple of mesh axis names (``()`` for None)."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def full_spec(spec, ndim: int, name: str = "logits") -> P:
  """``spec`` with one entry per dimension (missing trailing entries are None)."""
  entries = tuple(spec)
  if len(entries) > ndim:
    raise ValueError(
        f"{name}: out_sharding {spec} has {len(entries)} entries for logits of "
        f"rank {ndim}; give at most one per dimension, the last for the "
        "vocabulary."
    )
  return P(*entries, *(None,) * (ndim - len(entries)))


def vocab_axes_of(sharding, ndim: int, name: str = "logits") -> tuple[str, ...]:
  """The mesh axes a requested ``NamedSharding`` splits the last dimension over."""
  return axes_of(full_spec(sharding.spec, ndim, name)[-1])


def split_size(mesh, axes) -> int:
  """How many blocks ``axes`` split a dimension into on ``mesh``."""
  return math.prod(mesh.shape[a] for a in axes)


def place_logits(logits, num_embeddings: int, sharding: NamedSharding, name: str = "logits"):
  """Lays logits out as ``sharding``, padding the vocabulary if the split needs it.

  Args:
    logits: ``[..., num_embeddings]``, or already padded to the split (the
      vocab strategy's own blocks), padded columns zero.
    num_embeddings: the logical vocabulary size.
    sharding: the requested layout.
    name: the table's name, for errors.

  Returns:
    A ``jax.Array`` ``[..., num_embeddings]`` laid out as ``sharding`` when
    the split divides the vocabulary, else a ``VocabShardedLogits``.
  """
  spec = full_spec(sharding.spec, logits.ndim, name)
  blocks = split_size(sharding.mesh, axes_of(spec[-1]))
  padded_vocab = -(-num_embeddings // blocks) * blocks
  if logits.shape[-1] not in (num_embeddings, padded_vocab):
    raise ValueError(
        f"{name}: place_logits got {logits.shape[-1]} logits for a vocabulary of "
        f"{num_embeddings} split {blocks} ways; pass the logical logits or "
        f"logits padded to {padded_vocab}."
    )
  if logits.shape[-1] != padded_vocab:
    pad = [(0, 0)] * (logits.ndim - 1) + [(0, padded_vocab - num_embeddings)]
    logits = jnp.pad(logits, pad)
  logits = sharding_lib.place_always(logits, NamedSharding(sharding.mesh, spec))
  if padded_vocab == num_embeddings:
    return logits
  return VocabShardedLogits(logits, num_embeddings, sharding.mesh, spec)
