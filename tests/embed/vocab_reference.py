"""The single-device oracle of the vocab-parallel loss, and its test cases.

The reference is ``optax.softmax_cross_entropy_with_integer_labels`` on the
logical logits, plus ``z_loss * logsumexp ** 2``, with the documented label
rule: a label outside ``[0, vocab)`` contributes nothing and is left out of
the mean. It runs on one device from host copies, so no mesh is involved.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from tests.embed.contract import make_mesh

# name: (mesh shape, axis names). The table is vocab-sharded over the
# non-data axes, or over "batch" when it is the only axis (the token-sharded
# layout: the group's tokens are gathered before the product).
MESHES = {
    "1": ((1,), ("model",)),
    "2-tp": ((2,), ("model",)),
    "4-tp": ((4,), ("model",)),
    "2x4": ((2, 4), ("data", "model")),
    "8-tp": ((8,), ("model",)),
    "8-tokens": ((8,), ("batch",)),
}
# 50257 and 99 divide none of the groups above 1; 7 over 8 leaves a block
# of padding only; 104 divides them all (a plain jax.Array comes back).
SIZES = (99, 50257, 7, 104)
FEATURES = 20  # a size no token count or vocabulary block here has
TOKENS = 12  # divides no 8-device data split


def mesh_of(name):
  return make_mesh(*MESHES[name])


def vocab_spec(plan, ndim=2):
  """The ``out_sharding`` that keeps the table's vocab blocks (as ``plan`` lays them)."""
  outer = tuple(a for a in plan.data_axes if a not in plan.table_axes)
  return P(outer or None, *(None,) * (ndim - 2), plan.table_axes)


def host(x):
  return np.asarray(jax.device_get(x)).astype(np.float32)


def labels_for(vocab, tokens=TOKENS, seed=0):
  """Labels with every kind: in range, the last class, -1, -100 and ``vocab``."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, vocab, size=tokens)
  labels[:4] = [vocab - 1, -1, vocab, -100][: min(4, tokens)]
  return jnp.asarray(labels, jnp.int32)


def reference_losses(logits, labels, z_loss=0.0):
  """Per-token reference losses from logical f32 logits."""
  vocab = logits.shape[-1]
  valid = (labels >= 0) & (labels < vocab)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
  lse = jax.nn.logsumexp(logits, axis=-1)
  return jnp.where(valid, ce + z_loss * lse**2, 0.0)


def reference_loss(logits, labels, z_loss=0.0, reduction="mean"):
  losses = reference_losses(logits, labels, z_loss)
  if reduction == "none":
    return losses
  if reduction == "sum":
    return jnp.sum(losses)
  valid = (labels >= 0) & (labels < logits.shape[-1])
  return jnp.sum(losses) / jnp.maximum(jnp.sum(valid), 1)


def reference_step(table, query, labels, z_loss=0.0, dtype=jnp.float32):
  """Mean loss of ``query @ table.T`` and its gradients (table, query), on host copies."""
  table, query = jnp.asarray(host(table), dtype), jnp.asarray(host(query), dtype)

  def loss(t, q):
    return reference_loss((q @ t.T).astype(jnp.float32), labels, z_loss)

  return jax.value_and_grad(loss, argnums=(0, 1))(table, query)


COLLECTIVES = re.compile(r"\b(all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)(-start)?\(")


def collective_shapes(hlo_text):
  """The result shapes (dimension tuples) of every collective in compiled HLO."""
  shapes = []
  for line in hlo_text.splitlines():
    match = COLLECTIVES.search(line)
    if match is None or "=" not in line[: match.start()]:
      continue
    result = line[line.index("=") + 1 : match.start()]
    for dims in re.findall(r"\[([\d,]*)\]", result):
      shapes.append(tuple(int(d) for d in dims.split(",") if d))
  return shapes


def vocab_collectives(hlo_text, vocab, padded_vocab, group):
  """Collectives of logits: results with a vocabulary-sized dimension (whole,
  padded or a block) beside something other than ``FEATURES``.

  A table block's gradient (rows x features) is summed over the data axes
  on a data x model mesh: that is the data-parallel reduction, not logits.
  """
  sizes = {vocab, padded_vocab, padded_vocab // group} - {1}
  return [
      s for s in collective_shapes(hlo_text)
      if sizes & set(s) and set(s) - sizes - {FEATURES}
  ]
