"""The contract every ShardedEmbed layout is checked against.

The oracle is the single-device reference on the logical table:
``jnp.take(table, ids, axis=0)`` (zeros for invalid ids), ``query @ table.T``
and the gradients of both with respect to the logical table.

Tolerances: lookups are exact in every dtype (each output element is one
table element, and the partial sums of the vocab layout add exact zeros).
``attend`` and gradients with duplicate ids sum in a different order on a
sharded table, so f32 gets rtol 1e-5 / atol 1e-5 (a few ulps of the sums
here). bf16 keeps 8 bits of mantissa: rtol 2e-2, and for gradients, sums of
up to 16 products of magnitude ~2 rounded at every step, atol 2^-8 * 32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import embedlib


def make_mesh(shape, names, axis_types=None):
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, axis_types=axis_types, devices=jax.devices()[:n])


def reference_lookup(table, ids):
  valid = (ids >= 0) & (ids < table.shape[0])
  rows = jnp.take(table, jnp.clip(ids, 0, table.shape[0] - 1), axis=0)
  return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


def _host(x):
  return np.asarray(jax.device_get(x)).astype(np.float32)


def _contract_loss(lookups, logits, wo, wl):
  return (jnp.sum(lookups.astype(jnp.float32)**2 * wo)
          + jnp.sum(logits.astype(jnp.float32) * wl))


@nnx.jit
def _layout_results(emb, ids, query, wo, wl):
  """The lookup, attend and the loss's gradient, as one program: one compile per layout."""
  grads = nnx.grad(lambda m: _contract_loss(m(ids), m.attend(query), wo, wl))(emb)
  return emb(ids), emb.attend(query), grads.embedding.get_raw_value(), grads.embedding[...]


@jax.jit
def _reference_results(table, ids, query, wo, wl):
  """The reference's lookup, logits and gradient, as one program (not op by op)."""
  dtype = table.dtype
  attend = lambda t: query.astype(dtype) @ t.T
  grad = jax.grad(lambda t: _contract_loss(reference_lookup(t, ids), attend(t), wo, wl))(table)
  return reference_lookup(table, ids), attend(table), grad


def check_contract(emb, ids, query, *, rtol=1e-5, grad_atol=None):
  """Asserts forward, attend and both gradients equal the reference."""
  table = emb.logical_table()
  ref = jnp.asarray(_host(table), table.dtype)
  dtype = emb.dtype
  # Weights that differ per column and per row catch a misplaced slice.
  wo = jnp.linspace(-1.0, 2.0, emb.features, dtype=jnp.float32)
  wl = jnp.linspace(0.5, 1.5, emb.num_embeddings, dtype=jnp.float32)
  out, logits, grad, logical_grad = _layout_results(emb, ids, query, wo, wl)
  want_out, want_logits, want_grad = _reference_results(ref, ids, query, wo, wl)

  assert out.shape == ids.shape + (emb.features,)
  assert out.dtype == dtype
  np.testing.assert_array_equal(_host(out), _host(want_out))

  assert logits.shape == query.shape[:-1] + (emb.num_embeddings,)
  np.testing.assert_allclose(_host(logits), _host(want_logits), rtol=rtol, atol=rtol)

  physical = _host(grad)
  v, f = emb.num_embeddings, emb.features
  np.testing.assert_allclose(
      physical[:v, :f], _host(want_grad), rtol=rtol, atol=grad_atol or rtol)
  # Padding is storage only: it never receives a gradient, and the gradient
  # reads as the logical table, as the parameter does.
  assert not physical[v:].any() and not physical[:, f:].any()
  assert logical_grad.shape == (v, f)
  np.testing.assert_array_equal(_host(logical_grad), physical[:v, :f])


def random_case(num_embeddings, features, batch, seed=0, dtype=jnp.float32):
  """Ids with invalid and duplicate entries, and a query, for one check."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(-2, num_embeddings + 2, size=(batch, 3))
  ids[0, :2] = min(1, num_embeddings - 1)  # a duplicate id
  query = rng.normal(size=(batch, features)).astype(np.float32)
  return jnp.asarray(ids, jnp.int32), jnp.asarray(query, dtype)


def build(num_embeddings, features, mesh, **kwargs):
  return embedlib.ShardedEmbed(
      num_embeddings, features, mesh=mesh, rngs=nnx.Rngs(0), **kwargs
  )
