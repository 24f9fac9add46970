"""Arch blocks shared by the recommender models: MLPs and feature interactions."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib.kernels import interaction


class MLP(nnx.Module):
  """Dense layers with ReLU (or ``activation``) between them, none after the last.

  >>> from flax import nnx
  >>> mlp = MLP(13, (512, 256, 64), rngs=nnx.Rngs(0))
  >>> mlp(jnp.ones((2, 13))).shape
  (2, 64)

  Args:
    in_features: width of the input.
    sizes: width of each layer, the last one being the output width.
    final_activation: apply the activation after the last layer too (a
      bottom MLP feeding an interaction does, as in DLRM).
    activation: the nonlinearity between layers (default ReLU).
    rngs: random number generators.
  """

  def __init__(self, in_features: int, sizes: Sequence[int], *,
               final_activation: bool = False, activation=jax.nn.relu, rngs: nnx.Rngs):
    if not sizes:
      raise ValueError("MLP needs at least one layer size, e.g. sizes=(256, 64).")
    widths = (in_features,) + tuple(sizes)
    self.layers = nnx.List([
        nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:])
    ])
    self.final_activation = final_activation
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    last = len(self.layers) - 1
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i < last or self.final_activation:
        x = self.activation(x)
    return x


def dot_interaction(features, *, mesh=None) -> jax.Array:
  """DLRM's pairwise dot products, upper triangle without the diagonal.

  >>> dot_interaction(jnp.ones((2, 4, 3))).shape  # 4 vectors: 6 pairs
  (2, 6)
  >>> dot_interaction([jnp.ones((2, 3))] * 4).shape  # the same, unstacked
  (2, 6)

  Pass the vectors as a sequence when you have them apart (DLRM does): each
  pair is then one multiply-and-sum of two ``[batch, dim]`` vectors, which
  XLA fuses, forward and backward; on CPU a C++ kernel computes every pair
  of an example at once (``kernels/interaction.py``). The batched Gram
  matrix of a stacked array costs more (its ``[batch, n, n]`` matmuls are
  tiny, and the slices' transpose pads and adds ``n`` arrays of that size),
  and slicing a stacked array back into vectors costs more still, so a
  stacked array takes the Gram path.

  Args:
    features: a sequence of ``n`` arrays ``[batch, dim]``, or one array
      ``[batch, n, dim]``.
    mesh: for a sequence, the mesh whose data axes split the batch (None:
      the one set with ``jax.set_mesh``, else one device), where the C++
      kernel runs on each device's part (``interaction.dot_pairs``).

  Returns:
    ``[batch, n * (n - 1) / 2]``, pairs ``(i, j)``, ``i < j``, in row-major
    order.
  """
  if not isinstance(features, jax.Array):
    return interaction.dot_pairs(features, mesh=mesh)
  n = features.shape[1]
  gram = jnp.einsum("bnd,bmd->bnm", features, features)
  # Row i's pairs with the later vectors, as static slices, which XLA's CPU
  # backend runs faster (forward + backward) than a triu-index gather, in the
  # same pair order (i < j, row-major).
  return jnp.concatenate([gram[:, i, i + 1:] for i in range(n - 1)], axis=1)


class CrossNetwork(nnx.Module):
  """DCN-v2's cross layers: ``x_{l+1} = x0 * (W x_l + b) + x_l``.

  >>> from flax import nnx
  >>> CrossNetwork(8, 2, rngs=nnx.Rngs(0))(jnp.ones((3, 8))).shape
  (3, 8)

  Args:
    features: width of the input (and output).
    num_layers: number of cross layers.
    rngs: random number generators.
  """

  def __init__(self, features: int, num_layers: int, *, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(features, features, rngs=rngs)
                            for _ in range(num_layers)])

  def __call__(self, x0: jax.Array) -> jax.Array:
    x = x0
    for layer in self.layers:
      x = x0 * layer(x) + x
    return x


class RowDropout:
  """Dropout whose masks are drawn from one key per batch row, a fresh mask per call.

  The keys come with the batch (a data source's per-row seeds), so a run's
  masks depend only on its data position: a resumed run draws the masks an
  uninterrupted one does, and the model holds no random state to checkpoint.
  Each call (in trace order) folds its own number into the keys.

  >>> drop = RowDropout(jnp.array([1, 2], jnp.uint32), rate=0.5)
  >>> y = drop(jnp.ones((2, 1000)))
  >>> sorted(set(y.ravel().tolist())), bool(abs(float(y.mean()) - 1.0) < 0.1)
  ([0.0, 2.0], True)

  Args:
    seeds: uint32 ``[B]``, one per row.
    rate: the probability of zeroing an entry, in ``[0, 1)``.
  """

  def __init__(self, seeds: jax.Array, rate: float):
    if not 0.0 <= rate < 1.0:
      raise ValueError(f"config.model.dropout={rate} must lie in [0, 1).")
    self.keys = jax.vmap(jax.random.key)(seeds.astype(jnp.uint32))
    self.rate = rate
    self.calls = 0

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [B, ...]`` with entries zeroed at ``rate`` and the rest scaled by ``1 / (1 - rate)``."""
    if self.rate == 0.0:
      return x
    keys = jax.vmap(jax.random.fold_in, (0, None))(self.keys, self.calls)
    self.calls += 1
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - self.rate, x.shape[1:]))(keys)
    return jnp.where(keep, x / (1.0 - self.rate), 0.0).astype(x.dtype)


def no_dropout(x: jax.Array) -> jax.Array:
  """The identity: the dropout of an eval step."""
  return x
