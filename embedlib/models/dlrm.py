"""DLRM and DCN-v2 ranking models on an ``EmbeddingCollection``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib.collection import EmbeddingCollection, FeatureSpec, TableSpec
from embedlib.models.blocks import MLP, CrossNetwork, dot_interaction

DOT = "dot"
CROSS = "cross"
INTERACTIONS = (DOT, CROSS)


class DLRM(nnx.Module):
  """Dense bottom MLP + sparse embeddings -> interaction -> top MLP -> logit.

  ``interaction="dot"`` is DLRM (pairwise dot products of the bottom MLP's
  output and every feature's embedding: all widths must equal the bottom
  MLP's last size); ``"cross"`` is DCN-v2 (a cross network over the
  concatenation, any widths).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from embedlib import FeatureSpec, TableSpec
  >>> model = DLRM(
  ...     num_dense=3,
  ...     tables=[TableSpec("user", 100, 8), TableSpec("item", 50, 8)],
  ...     features=[FeatureSpec("user", "user", max_ids_per_sample=1),
  ...               FeatureSpec("items", "item")],
  ...     bottom_sizes=(16, 8), top_sizes=(16, 1), rngs=nnx.Rngs(0))
  >>> model(jnp.ones((2, 3)), {"user": jnp.array([1, 2]),
  ...                          "items": jnp.array([[1, 2], [3, -1]])}).shape
  (2,)

  Args:
    num_dense: width of the dense input.
    tables: the embedding tables.
    features: the categorical features (pooled; sequence features are not
      part of DLRM).
    bottom_sizes: bottom MLP layer widths.
    top_sizes: top MLP layer widths; the last is the number of logits a
      row (1: logits ``[batch]``; K: ``[batch, K]``, one a label).
    interaction: ``"dot" | "cross"``.
    cross_layers: number of DCN-v2 cross layers.
    rngs: random number generators.
    **collection_kwargs: passed to ``EmbeddingCollection`` (``mesh``,
      ``layout``: an ``embedlib.CollectionLayout``).
  """

  def __init__(
      self,
      *,
      num_dense: int,
      tables: Sequence[TableSpec],
      features: Sequence[FeatureSpec],
      bottom_sizes: Sequence[int],
      top_sizes: Sequence[int],
      interaction: str = DOT,
      cross_layers: int = 3,
      rngs: nnx.Rngs,
      **collection_kwargs,
  ):
    if interaction not in INTERACTIONS:
      raise ValueError(f"DLRM: interaction={interaction!r}; use one of {INTERACTIONS}.")
    if not top_sizes or top_sizes[-1] < 1:
      raise ValueError(f"DLRM: top_sizes={tuple(top_sizes)} must end in the number of "
                       "logits a row (1 for one label).")
    widths = {t.name: t.features for t in tables}
    dim = bottom_sizes[-1]
    for f in features:
      if f.combiner is None:
        raise ValueError(f"DLRM: feature {f.name!r} is a sequence feature "
                         "(combiner=None); give it a combiner such as 'sum'.")
      if interaction == DOT and widths.get(f.table, dim) != dim:
        raise ValueError(
            f"DLRM: feature {f.name!r} reads table {f.table!r} of width "
            f"{widths[f.table]}, but the dot interaction needs every width equal "
            f"to the bottom MLP's output ({dim}); set the table width to {dim} "
            f"or use interaction='cross'.")
    self.feature_names = tuple(f.name for f in features)
    self.interaction = interaction
    # Without dense features there is no bottom MLP: the features interact alone.
    self.bottom = (MLP(num_dense, bottom_sizes, final_activation=True, rngs=rngs)
                   if num_dense else None)
    self.embeddings = EmbeddingCollection(tables, features, rngs=rngs, **collection_kwargs)
    bottom = dim if num_dense else 0
    n = len(features) + (1 if num_dense else 0)
    if interaction == DOT:
      self.cross = None
      top_in = bottom + n * (n - 1) // 2
    else:
      top_in = bottom + sum(widths[f.table] for f in features)
      self.cross = CrossNetwork(top_in, cross_layers, rngs=rngs)
    self.top = MLP(top_in, top_sizes, rngs=rngs)

  def __call__(self, dense: jax.Array, sparse: Mapping[str, jax.Array],
               weights: Mapping[str, jax.Array] | None = None) -> jax.Array:
    """Logits ``[batch]`` (``[batch, K]`` for K outputs) from dense ``[batch, num_dense]``
    and sparse ids (``weights``: per-id weights of pooled features, as the collection's)."""
    embedded = self.embeddings(sparse, weights)
    x = [] if self.bottom is None else [self.bottom(dense)]
    dtype = x[0].dtype if x else dense.dtype
    vectors = x + [embedded[name].astype(dtype) for name in self.feature_names]
    if self.interaction == DOT:
      # On CPU a C++ kernel, on each device's part of the batch (kernels/interaction.py).
      z = jnp.concatenate(x + [dot_interaction(vectors, mesh=self.embeddings.mesh)], axis=1)
    else:
      z = self.cross(jnp.concatenate(vectors, axis=1))
    out = self.top(z)
    return out[:, 0] if out.shape[1] == 1 else out
