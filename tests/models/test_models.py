"""Model blocks and the DLRM family: shapes, the interaction, config errors."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from embedlib import FeatureSpec, TableSpec
from embedlib.data.spec import DataSpec, SparseFeature
from embedlib.models import DLRM, build_model, dot_interaction


@pytest.mark.parametrize("n", [2, 5, 27])
def test_dot_interaction_is_the_strict_upper_triangle_of_the_gram(n):
  f = jax.random.normal(jax.random.key(n), (3, n, 4))
  gram = np.einsum("bnd,bmd->bnm", f, f)
  rows, cols = np.triu_indices(n, k=1)
  want = gram[:, rows, cols]
  # Each form and its gradient as one program (op by op, the list of 27
  # vectors would compile a program per primitive).
  cot = jax.random.normal(jax.random.key(0), want.shape)
  out = jax.jit(dot_interaction)
  grad = jax.jit(jax.grad(lambda x: jnp.sum(dot_interaction(x) * cot)))
  np.testing.assert_allclose(out(f), want, rtol=1e-5, atol=1e-6)
  vectors = [f[:, i] for i in range(n)]
  np.testing.assert_allclose(out(vectors), want, rtol=1e-5, atol=1e-6)
  # Gradients of both forms agree too.
  stacked, apart = grad(f), grad(vectors)
  np.testing.assert_allclose(np.stack(apart, 1), stacked, rtol=1e-5, atol=1e-5)


def _model(interaction, widths=(8, 8)):
  return DLRM(
      num_dense=3,
      tables=[TableSpec("a", 20, widths[0]), TableSpec("b", 10, widths[1])],
      features=[FeatureSpec("a", "a", max_ids_per_sample=1), FeatureSpec("b", "b")],
      bottom_sizes=(16, 8), top_sizes=(16, 1), interaction=interaction, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("interaction, widths", [("dot", (8, 8)), ("cross", (8, 4))])
def test_dlrm_logits_and_gradients(interaction, widths):
  model = _model(interaction, widths)
  dense = jnp.ones((4, 3))
  sparse = {"a": jnp.array([0, 1, 19, -1]), "b": jnp.array([[1, 2], [3, -1], [-1, -1], [9, 9]])}
  # One program for the logits and their gradient (op by op, each primitive
  # of the model would compile its own).
  (_, logits), grads = nnx.jit(nnx.value_and_grad(
      lambda m: (jnp.sum(m(dense, sparse)), m(dense, sparse)), has_aux=True))(model)
  assert logits.shape == (4,) and bool(jnp.all(jnp.isfinite(logits)))
  table_a = grads.embeddings.tables["a"].embedding[...]
  assert np.asarray(table_a)[[0, 1, 19]].any() and not np.asarray(table_a)[2:19].any()


def test_dot_interaction_needs_equal_widths():
  with pytest.raises(ValueError, match="feature 'b' reads table 'b' of width 4.*interaction='cross'"):
    _model("dot", (8, 4))


def test_factory_rejects_unknown_model():
  cfg = ml_collections.ConfigDict(dict(name="wide_deep", embed_dim=8))
  with pytest.raises(ValueError, match="'wide_deep'.*'dlrm'"):
    build_model(cfg, DataSpec(2, (SparseFeature("a", 10),)), rngs=nnx.Rngs(0))


def test_model_config_id_skew_gives_each_table_its_skew():
  from embedlib.models import factory
  spec = DataSpec(4, (SparseFeature("a", 100), SparseFeature("b", 10, bag_size=3)))
  skews = lambda v: factory.id_skews(ml_collections.ConfigDict(dict(id_skew=v)), spec)
  assert skews(None) == {"a": 0.0, "b": 0.0}
  assert skews(1.05) == {"a": 1.05, "b": 1.05}
  assert skews({"a": 0.9}) == {"a": 0.9, "b": 0.0}
  with pytest.raises(ValueError, match="names table 'c', which is not among"):
    skews({"c": 1.0})
  with pytest.raises(ValueError, match="python -m train fits 'fit' from the first training"):
    skews("fit")
