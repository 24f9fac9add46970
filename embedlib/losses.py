"""Softmax cross-entropy from logits split over the vocabulary (Megatron-style).

A tied output layer over a 50k to 256k vocabulary makes logits far larger
than anything else in a step: ``[tokens, vocab]``. With the vocabulary split
over a group of devices (``ShardedEmbed.attend(q, out_sharding=P(..., axes))``)
the loss never needs them whole: each device reduces its own block and only
per-token numbers cross the group, ``pmax`` of the row maxima, ``psum`` of
the sums of exponentials and ``psum`` of the label's logit, taken by the
rank that owns the label. The backward pass is one elementwise pass over
each block (``softmax - onehot`` from the saved log-sum-exp), with no
communication and nothing saved but the logits and ``[tokens]`` numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import _compat
from embedlib import invalid_ids as invalid_lib
from embedlib import logits as logits_lib
from embedlib import sharding as sharding_lib

REDUCTIONS = ("none", "mean", "sum")


def vocab_parallel_cross_entropy(
    logits,
    labels,
    *,
    z_loss: float = 0.0,
    reduction: str = "none",
    mesh=None,
    vocab_axes=None,
):
  """Softmax cross-entropy of integer labels, reduced across a vocabulary split.

  Equals ``optax.softmax_cross_entropy_with_integer_labels(logits, labels)``
  on the logical logits, plus ``z_loss * logsumexp(logits) ** 2`` per token
  (the PaLM / T5X z-loss), gradients included. When the vocabulary is split
  over mesh axes no device holds more than its own block of logits.

  >>> import jax, jax.numpy as jnp
  >>> logits = jnp.array([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
  >>> vocab_parallel_cross_entropy(logits, jnp.array([0, -1])).round(4).tolist()
  [0.1698, 0.0]

  Where the split comes from, first that applies:

  - a ``VocabShardedLogits`` (``attend`` with a split that doesn't divide
    the vocabulary) carries its layout;
  - ``mesh`` and ``vocab_axes``: the last dimension is split over
    ``vocab_axes`` of ``mesh`` (padded first if the split doesn't divide it);
  - the layout of a ``jax.Array`` (a concrete array's ``sharding``, or the
    sharding type of a traced one on Explicit mesh axes);
  - none (plain logits, or traced on Auto axes): the same arithmetic runs
    unsplit, and the compiler partitions it as it likes. Pass ``mesh`` and
    ``vocab_axes`` to keep the logits split under ``jit`` on Auto axes.

  Labels: a label outside ``[0, vocab)`` (e.g. ``-1`` or ``-100`` for
  padding tokens) is ignored: its token's loss is 0 with zero gradient, and
  ``reduction="mean"`` leaves it out of the count.

  Args:
    logits: ``[..., vocab]`` float, a ``jax.Array`` or ``VocabShardedLogits``.
    labels: ``[...]`` integers of any dtype, the leading shape of ``logits``.
    z_loss: weight of ``logsumexp ** 2`` (a Python float; 0 for none).
    reduction: ``"none"`` (per-token losses), ``"mean"`` (over the valid
      labels; 0 when there are none) or ``"sum"``.
    mesh: a ``Mesh`` or ``AbstractMesh``, with ``vocab_axes``.
    vocab_axes: mesh axis name(s) the vocabulary is split over, in block
      order.

  Returns:
    float32: ``[...]`` for ``"none"``, a scalar otherwise. The loss is
    computed in float32 whatever the logits' dtype; the gradient with
    respect to the logits has their dtype.
  """
  if reduction not in REDUCTIONS:
    raise ValueError(
        f"vocab_parallel_cross_entropy: reduction={reduction!r}; use one of {REDUCTIONS}."
    )
  if (mesh is None) != (vocab_axes is None):
    raise ValueError(
        "vocab_parallel_cross_entropy: pass mesh= and vocab_axes= together "
        "(the mesh axes the vocabulary is split over), or neither to read "
        "the split from the logits."
    )
  x, layout = _layout(logits, mesh, vocab_axes)
  labels = labels if isinstance(labels, jax.Array) else np.asarray(labels)
  if tuple(labels.shape) != tuple(x.shape[:-1]):
    raise ValueError(
        f"vocab_parallel_cross_entropy: labels of shape {tuple(labels.shape)} for "
        f"logits of shape {layout.shape(x)}; labels need the logits' shape "
        "without the vocabulary dimension."
    )
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(
        f"vocab_parallel_cross_entropy: labels must be integers, got "
        f"{labels.dtype}; cast them with .astype(jnp.int32)."
    )
  # Host labels are range-tested in full precision before JAX narrows them.
  labels = invalid_lib.as_ids(labels, layout.vocab)
  return _loss(x, labels, layout=layout, z_loss=float(z_loss), reduction=reduction)


@functools.partial(jax.jit, static_argnames=("layout", "z_loss", "reduction"))
def _loss(x, labels, *, layout, z_loss, reduction):
  # Jitted: called eagerly, shard_map would run op by op.
  labels = invalid_lib.sanitize(labels, layout.vocab)
  if layout.mesh is not None:
    # Laid out before the custom_vjp: on Explicit axes its gradient must
    # have the sharding of its input.
    x = sharding_lib.place(x, layout.mesh, P(*layout.spec))
    labels = sharding_lib.place(labels, layout.mesh, P(*tuple(layout.spec)[:-1]))
  losses = _token_losses(x, labels, layout, z_loss)
  if reduction == "none":
    return losses
  total = jnp.sum(losses)
  if reduction == "sum":
    return total
  return total / jnp.maximum(jnp.sum(labels >= 0), 1).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where a loss's logits live: the static half of ``_token_losses``."""

  vocab: int  # logical vocabulary size
  mesh: tp.Any = None  # None: plain logits, no shard_map
  spec: tp.Any = None  # PartitionSpec of the (padded) logits

  @property
  def axes(self) -> tuple[str, ...]:
    return logits_lib.axes_of(self.spec[-1]) if self.mesh is not None else ()

  def shape(self, x) -> tuple[int, ...]:
    return tuple(x.shape[:-1]) + (self.vocab,)


def _layout(logits, mesh, vocab_axes):
  """The (padded) logits array and its ``_Layout``."""
  if isinstance(logits, logits_lib.VocabShardedLogits):
    if mesh is not None:
      raise ValueError(
          "vocab_parallel_cross_entropy: VocabShardedLogits carry their own "
          "layout; drop mesh= and vocab_axes=."
      )
    return logits.padded, _Layout(logits.num_embeddings, logits.mesh, logits.spec)
  x = logits if isinstance(logits, jax.Array) else jnp.asarray(logits)
  vocab = x.shape[-1]
  own = _sharding_of(x)
  if mesh is None:
    if own is None:
      return x, _Layout(vocab)
    return x, _Layout(vocab, own.mesh, logits_lib.full_spec(own.spec, x.ndim))
  lead = (None,) * (x.ndim - 1)
  if own is not None and own.mesh.axis_names == mesh.axis_names:
    lead = tuple(logits_lib.full_spec(own.spec, x.ndim))[:-1]
  axes = logits_lib.axes_of(vocab_axes)
  spec = P(*lead, axes or None)
  blocks = logits_lib.split_size(mesh, axes)
  pad = -vocab % blocks
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x, _Layout(vocab, mesh, spec)


def _sharding_of(x) -> NamedSharding | None:
  """``x``'s ``NamedSharding`` where jax knows it (concrete, or Explicit axes)."""
  if isinstance(x, jax.core.Tracer):
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not sharding_lib.is_explicit(mesh, mesh.axis_names):
      return None
    return sharding
  sharding = getattr(x, "sharding", None)
  return sharding if isinstance(sharding, NamedSharding) else None


# -- the loss and its gradient ----------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _token_losses(x, labels, layout, z_loss):
  return _forward(x, labels, layout, z_loss)[0]


def _token_losses_fwd(x, labels, layout, z_loss):
  losses, lse = _forward(x, labels, layout, z_loss)
  return losses, (x, labels, lse)


def _token_losses_bwd(layout, z_loss, residuals, g):
  x, labels, lse = residuals
  body = functools.partial(_block_grad, vocab=layout.vocab, axes=layout.axes, z_loss=z_loss)
  return _map_blocks(body, (x, labels, lse, g), layout, vocab_dims=(True, False, False, False),
                     out_vocab_dims=True), None


_token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


def _forward(x, labels, layout, z_loss):
  body = functools.partial(_block_forward, vocab=layout.vocab, axes=layout.axes, z_loss=z_loss)
  return _map_blocks(body, (x, labels), layout, vocab_dims=(True, False),
                     out_vocab_dims=(False, False))


def _map_blocks(body, args, layout, *, vocab_dims, out_vocab_dims):
  """Runs ``body`` on each device's block (``shard_map``), or whole without a mesh.

  ``vocab_dims`` / ``out_vocab_dims``: per argument / output, whether it has
  the vocabulary dimension (laid out as ``layout.spec``) or only the leading
  ones (``layout.spec`` without its last entry).
  """
  if layout.mesh is None:
    return body(*args)
  spec = P(*layout.spec)
  lead = P(*tuple(layout.spec)[:-1])
  pick = lambda has_vocab: spec if has_vocab else lead
  in_specs = tuple(pick(v) for v in vocab_dims)
  out_specs = jax.tree.map(pick, out_vocab_dims)
  args = tuple(sharding_lib.place(a, layout.mesh, s) for a, s in zip(args, in_specs))
  return _compat.shard_map(body, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs)(*args)


def _block_columns(width, axes):
  """Global vocabulary index of each column of this device's block."""
  start = lax.axis_index(axes) * width if axes else 0
  return start + lax.iota(jnp.int32, width)


def _block_forward(x, labels, *, vocab, axes, z_loss):
  """Per-token loss and log-sum-exp from this device's block of logits.

  Args:
    x: ``[..., width]`` logits, this block of the (padded) vocabulary.
    labels: ``[...]`` int32, ``-1`` for ignored tokens.

  Returns:
    ``(losses [...] float32, lse [...] float32)``, the same on every device
    of the vocabulary group.
  """
  cols = _block_columns(x.shape[-1], axes)
  x = x.astype(jnp.float32)
  x = jnp.where(cols < vocab, x, -jnp.inf)  # padded columns are no class
  # The max only keeps exp in range; it cancels from the gradient, so none
  # flows through it (pmax has no derivative).
  peak = _reduce(lax.pmax, lax.stop_gradient(jnp.max(x, axis=-1)), axes)
  total = _reduce(lax.psum, jnp.sum(jnp.exp(x - peak[..., None]), axis=-1), axes)
  lse = peak + jnp.log(total)
  # A label is a real column of one block; -1 is in none. Gathered, one
  # logit per token: a one-hot mask over the block would be another
  # block-sized temporary (XLA:CPU materialises it).
  local = labels - cols[0]
  mine = (labels >= 0) & (local >= 0) & (local < x.shape[-1])
  picked = jnp.take_along_axis(x, jnp.clip(local, 0, x.shape[-1] - 1)[..., None], axis=-1)
  label_logit = jnp.where(mine, picked[..., 0], 0.0)
  losses = lse - _reduce(lax.psum, label_logit, axes) + z_loss * lse**2
  return jnp.where(labels >= 0, losses, 0.0), lse


def _block_grad(x, labels, lse, g, *, vocab, axes, z_loss):
  """d(losses)/d(x) . g on this device's block: no communication.

  ``(1 + 2 z lse) softmax - onehot(label)`` per token, scaled by its
  cotangent; zero for ignored tokens and padded columns.
  """
  cols = _block_columns(x.shape[-1], axes)
  softmax = jnp.where(cols < vocab, jnp.exp(x.astype(jnp.float32) - lse[..., None]), 0.0)
  scale = jnp.where(labels >= 0, g, 0.0)[..., None]
  onehot = (cols == labels[..., None]).astype(jnp.float32)
  dx = scale * ((1.0 + 2.0 * z_loss * lse)[..., None] * softmax - onehot)
  return dx.astype(x.dtype)


def _reduce(collective, x, axes):
  return collective(x, axes) if axes else x
