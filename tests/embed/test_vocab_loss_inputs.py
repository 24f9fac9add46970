"""What ``vocab_parallel_cross_entropy`` accepts: labels, plain logits, layouts, mistakes.

The rule for labels: one outside ``[0, vocab)`` (any integer dtype, host
or device) is ignored: loss 0, no gradient, left out of the mean. Plain
(unsharded) logits and logits whose split is given with ``mesh=`` /
``vocab_axes=`` give the same numbers as sharded ones. Tolerances as in
``test_vocab_parallel``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import embedlib
from tests.embed import vocab_reference as ref
from tests.embed.contract import make_mesh

VOCAB = 99


def _logits(vocab=VOCAB, tokens=ref.TOKENS, seed=3):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(tokens, vocab)).astype(np.float32) * 2


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint64])
def test_labels_of_every_integer_dtype(dtype):
  logits = _logits()
  info = np.iinfo(dtype)
  labels = np.array([0, 98, 5, 7, 1, 2, 3, 4, 6, 8, 9, 10], dtype)
  labels[2] = min(info.max, 99)  # one past the vocabulary
  labels[3] = info.max  # far past it (2**64 - 1 for uint64)
  if info.min < 0:
    labels[4] = -1
  as_int64 = labels.astype(np.int64) if dtype != np.uint64 else np.where(labels > 200, 200, labels)
  got = embedlib.vocab_parallel_cross_entropy(logits, labels)
  want = ref.reference_losses(jnp.asarray(logits), jnp.asarray(as_int64, jnp.int32))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  assert got[2] == 0 and got[3] == 0 and (info.min >= 0 or got[4] == 0)


def test_host_int64_labels_are_not_narrowed():
  """``2**32 + 5`` is invalid, not label 5 (JAX would keep its low 32 bits)."""
  logits = _logits()
  labels = np.full((ref.TOKENS,), 5, np.int64)
  labels[0] = 2**32 + 5
  got = np.asarray(embedlib.vocab_parallel_cross_entropy(logits, labels))
  assert got[0] == 0 and got[1] > 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_no_valid_label_gives_zero_and_no_nan(reduction):
  logits = jnp.asarray(_logits())
  labels = jnp.full((ref.TOKENS,), -1, jnp.int32)
  loss = lambda x: embedlib.vocab_parallel_cross_entropy(x, labels, reduction=reduction)
  value, grad = jax.value_and_grad(loss)(logits)
  assert float(value) == 0.0
  assert not np.asarray(grad).any()


def test_plain_logits_of_any_rank():
  """Unsharded logits ``[batch, seq, vocab]``, per-token losses ``[batch, seq]``."""
  logits = _logits().reshape(3, 4, VOCAB)
  labels = np.asarray(ref.labels_for(VOCAB)).reshape(3, 4)
  got = embedlib.vocab_parallel_cross_entropy(logits, labels, z_loss=1e-2)
  want = ref.reference_losses(jnp.asarray(logits), jnp.asarray(labels), 1e-2)
  assert got.shape == (3, 4) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_split_given_by_mesh_and_vocab_axes(axis_type):
  """Replicated logits split (padded 99 -> 100) as ``vocab_axes`` says, under jit too."""
  mesh = make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
  logits = jax.device_put(_logits(), NamedSharding(mesh, P("data")))
  labels = jax.device_put(ref.labels_for(VOCAB), NamedSharding(mesh, P("data")))

  def loss(x):
    return embedlib.vocab_parallel_cross_entropy(
        x, labels, mesh=mesh, vocab_axes="model", reduction="mean")

  step = jax.jit(jax.value_and_grad(loss))
  value, grad = step(logits)
  want, want_grad = jax.value_and_grad(
      lambda x: ref.reference_loss(x, jnp.asarray(np.asarray(labels))))(jnp.asarray(_logits()))
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-5, atol=1e-6)
  # The loss sends only per-token numbers across the model axis: the padded
  # logits' blocks of 25 columns never travel. (Their gradient does: these
  # logits are whole on every model rank, so is their gradient.)
  hlo = jax.jit(loss).lower(logits).compile().as_text()
  assert not [s for s in ref.collective_shapes(hlo) if {25, 100} & set(s)]


def test_evenly_split_array_is_read_from_its_sharding():
  mesh = make_mesh((4,), ("model",))
  full = _logits(vocab=104)
  logits = jax.device_put(full, NamedSharding(mesh, P(None, "model")))
  labels = ref.labels_for(104)
  got = embedlib.vocab_parallel_cross_entropy(logits, labels, reduction="sum")
  want = ref.reference_loss(jnp.asarray(full), labels, reduction="sum")
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(reduction="avg"), "reduction='avg'"),
        (dict(mesh="m"), "mesh= and vocab_axes= together"),
        (dict(vocab_axes="model"), "mesh= and vocab_axes= together"),
    ],
)
def test_option_errors(kwargs, pattern):
  with pytest.raises(ValueError, match=pattern):
    embedlib.vocab_parallel_cross_entropy(_logits(), np.zeros(ref.TOKENS, np.int32), **kwargs)


def test_label_errors():
  with pytest.raises(ValueError, match=r"labels of shape \(11,\).*\(12, 99\)"):
    embedlib.vocab_parallel_cross_entropy(_logits(), np.zeros(11, np.int32))
  with pytest.raises(ValueError, match=r"integers, got float32.*astype"):
    embedlib.vocab_parallel_cross_entropy(_logits(), np.zeros(ref.TOKENS, np.float32))
