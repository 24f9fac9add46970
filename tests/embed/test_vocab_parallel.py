"""Vocab-parallel logits and loss equal the single-device reference.

``attend(q, out_sharding=<vocab split>)`` keeps each device's block of
logits (no collective of vocabulary size in the compiled program), and
``vocab_parallel_cross_entropy`` on them equals optax on the logical logits,
value and gradients, end to end through ``attend`` to the table and the
query, over meshes x awkward vocabularies (``vocab_reference``).

Tolerances. f32: the loss sums ``exp`` over the vocabulary in blocks, then
across the group, where the reference sums in one pass; the log-sum-exp
agrees to a few ulps, so rtol 1e-5 / atol 1e-6 for losses and for gradients
(each gradient element is one softmax term minus a one-hot, scaled).
bf16 logits: the loss upcasts to f32 as the reference does, so on the same
logits it keeps f32's tolerance; the gradient with respect to bf16 logits is
rounded to bf16 (8 bits: relative error 2^-8 of values within [-1, 1]),
atol 2^-8. End to end in bf16 the table and query gradients are sums of 16
to 104 such products rounded at every step: the contract's bf16 tolerance,
rtol 2e-2 / atol 32 * 2^-8.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import embedlib
from tests.embed import vocab_reference as ref
from tests.embed.contract import build, make_mesh


# z_loss alternates over the mesh x vocabulary grid. CI runs each mesh with
# both z_loss values and each vocabulary on three meshes with both: 7 (a
# block of padding only) on 2x4 and the 8-rank splits, 50257 on 2-tp, 2x4
# and 8-tp, 99 and 104 (which divides every group) on the rest. ``-m slow``
# runs the rest of the product.
CI = {"1": (99, 104), "2-tp": (99, 50257), "4-tp": (99, 104), "2x4": (7, 50257),
      "8-tp": (7, 50257), "8-tokens": (7, 104)}


def _cases():
  for i, name in enumerate(ref.MESHES):
    for j, vocab in enumerate(ref.SIZES):
      yield pytest.param(name, vocab, 1e-3 if (i + j) % 2 else 0.0,
                         id=f"{name}-{vocab}-z{(i + j) % 2}",
                         marks=() if vocab in CI[name] else pytest.mark.slow)


def _vocab_table(mesh_name, vocab, **kwargs):
  mesh = ref.mesh_of(mesh_name)
  return build(vocab, ref.FEATURES, mesh, sharding="vocab", **kwargs)


def _query(dtype=jnp.float32, tokens=ref.TOKENS, seed=1):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.normal(size=(tokens, ref.FEATURES)), dtype)


@pytest.mark.parametrize("mesh_name, vocab, z_loss", list(_cases()))
def test_loss_through_attend_matches_optax(mesh_name, vocab, z_loss):
  emb = _vocab_table(mesh_name, vocab)
  spec = ref.vocab_spec(emb.plan)
  query, labels = _query(), ref.labels_for(vocab)

  def loss(m, q):
    logits = m.attend(q, out_sharding=spec)
    return embedlib.vocab_parallel_cross_entropy(logits, labels, z_loss=z_loss, reduction="mean")

  value, (g_emb, g_query) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(emb, query)
  want, (want_table, want_query) = ref.reference_step(emb.logical_table(), query, labels, z_loss)
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
  physical = ref.host(g_emb.embedding.get_raw_value())
  np.testing.assert_allclose(physical[:vocab], want_table, rtol=1e-5, atol=1e-6)
  assert not physical[vocab:].any()  # padded rows get no gradient
  np.testing.assert_allclose(ref.host(g_query), want_query, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_name", ["2-tp", "2x4", "8-tp", "8-tokens"])
@pytest.mark.parametrize("vocab", [99, 104])
def test_attend_keeps_vocab_blocks(mesh_name, vocab):
  emb = _vocab_table(mesh_name, vocab)
  spec = ref.vocab_spec(emb.plan)
  query = _query()
  attend = nnx.jit(lambda m, q, s: m.attend(q, out_sharding=s), static_argnums=2)
  logits = attend(emb, query, spec)
  padded_vocab, group = emb.plan.padded_shape[0], emb.plan.group_size
  assert logits.shape == (ref.TOKENS, vocab)
  if padded_vocab == vocab:
    assert isinstance(logits, jax.Array)
    whole, stored = logits, logits
  else:
    assert isinstance(logits, embedlib.VocabShardedLogits)
    whole, stored = logits.unpadded(), logits.padded
    assert stored.shape == (ref.TOKENS, padded_vocab)
  assert stored.sharding.spec == spec
  block = {s.data.shape for s in stored.addressable_shards}
  assert {b[-1] for b in block} == {padded_vocab // group}
  expected = ref.host(query) @ ref.host(emb.logical_table()).T
  np.testing.assert_allclose(ref.host(whole), expected, rtol=1e-5, atol=1e-5)
  hlo = attend.lower(emb, query, spec).compile().as_text()
  assert ref.vocab_collectives(hlo, vocab, padded_vocab, group) == []
  # Without out_sharding the same table concatenates its logits: the check
  # above would see it.
  hlo = attend.lower(emb, query, None).compile().as_text()
  assert ref.vocab_collectives(hlo, vocab, padded_vocab, group)


@pytest.mark.parametrize("mesh_name", ["2-tp", "2x4", "8-tokens"])
def test_loss_and_gradient_communicate_per_token_numbers_only(mesh_name):
  emb = _vocab_table(mesh_name, 99)
  spec = ref.vocab_spec(emb.plan)
  labels = ref.labels_for(99)

  def loss(m, q):
    return embedlib.vocab_parallel_cross_entropy(
        m.attend(q, out_sharding=spec), labels, z_loss=1e-3, reduction="mean")

  step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))
  hlo = step.lower(emb, _query()).compile().as_text()
  assert ref.vocab_collectives(hlo, 99, emb.plan.padded_shape[0], emb.plan.group_size) == []


@pytest.mark.parametrize("strategy", ["hidden", "replicated"])
@pytest.mark.parametrize("vocab", [99, 104])
def test_other_layouts_honour_a_vocab_split(strategy, vocab):
  """Hidden and replicated tables sum or compute the logits whole, then split them."""
  mesh = make_mesh((2, 4), ("data", "model"))
  emb = build(vocab, ref.FEATURES, mesh, sharding=strategy)
  spec, labels, query = P("data", "model"), ref.labels_for(vocab), _query()

  def loss(m, q):
    return embedlib.vocab_parallel_cross_entropy(m.attend(q, out_sharding=spec), labels)

  logits = emb.attend(query, out_sharding=spec)
  stored = logits if vocab % 4 == 0 else logits.padded
  assert stored.sharding.spec == spec and logits.shape == (ref.TOKENS, vocab)
  value, g_query = nnx.jit(nnx.value_and_grad(
      lambda m, q: jnp.mean(loss(m, q)), argnums=1))(emb, query)
  table = ref.host(emb.logical_table())
  want = ref.reference_losses(ref.host(query) @ table.T, labels)
  np.testing.assert_allclose(float(value), float(jnp.mean(want)), rtol=1e-5)
  _, (_, want_query) = jax.value_and_grad(
      lambda t, q: jnp.mean(ref.reference_losses(q @ t.T, labels)), argnums=(0, 1))(
          jnp.asarray(table), jnp.asarray(ref.host(query)))
  np.testing.assert_allclose(ref.host(g_query), want_query, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_gradient_wrt_vocab_sharded_logits(reduction, z_loss):
  """Padded logits: the loss ignores whatever the padding holds; it gets no gradient."""
  mesh = make_mesh((4,), ("model",))
  rng = np.random.default_rng(2)
  full = rng.normal(size=(ref.TOKENS, 104)).astype(np.float32) * 3
  full[:, 99:] = 1e4  # padding that would dominate any softmax it entered
  padded = jax.device_put(full, NamedSharding(mesh, P(None, "model")))
  logits = embedlib.VocabShardedLogits(padded, 99, mesh, P(None, "model"))
  labels = ref.labels_for(99)

  def loss(x):
    out = embedlib.vocab_parallel_cross_entropy(x, labels, z_loss=z_loss, reduction=reduction)
    return jnp.sum(out * jnp.arange(1.0, ref.TOKENS + 1)) if reduction == "none" else out

  def want_loss(x):
    out = ref.reference_loss(x, labels, z_loss, reduction)
    return jnp.sum(out * jnp.arange(1.0, ref.TOKENS + 1)) if reduction == "none" else out

  value, grad = jax.jit(jax.value_and_grad(loss))(logits)
  want, want_grad = jax.value_and_grad(want_loss)(jnp.asarray(full[:, :99]))
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
  got = ref.host(grad.padded)
  np.testing.assert_allclose(got[:, :99], want_grad, rtol=1e-5, atol=1e-6)
  assert not got[:, 99:].any()


@pytest.mark.parametrize("mesh_name", ["2x4", "8-tokens"])
def test_bf16_logits(mesh_name):
  emb = _vocab_table(mesh_name, 99, param_dtype=jnp.bfloat16)
  spec, labels, query = ref.vocab_spec(emb.plan), ref.labels_for(99), _query(jnp.bfloat16)
  logits = emb.attend(query, out_sharding=spec)
  assert logits.dtype == jnp.bfloat16

  def loss(x):
    return embedlib.vocab_parallel_cross_entropy(x, labels, z_loss=1e-3, reduction="mean")

  value, grad = jax.jit(jax.value_and_grad(loss))(logits)
  assert grad.dtype == jnp.bfloat16
  same = jnp.asarray(ref.host(logits.unpadded()))  # the very bf16 values, in f32
  want, want_grad = jax.value_and_grad(lambda x: ref.reference_loss(x, labels, 1e-3))(same)
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
  np.testing.assert_allclose(ref.host(grad.padded)[:, :99], want_grad, rtol=0, atol=2.0**-8)

  def step(m, q):
    return loss(m.attend(q, out_sharding=spec))

  _, (g_emb, g_query) = nnx.jit(nnx.value_and_grad(step, argnums=(0, 1)))(emb, query)
  _, (want_table, want_query) = ref.reference_step(
      emb.logical_table(), query, labels, 1e-3, dtype=jnp.bfloat16)
  tol = dict(rtol=2e-2, atol=32 * 2.0**-8)
  np.testing.assert_allclose(ref.host(g_emb.embedding.get_raw_value())[:99], ref.host(want_table), **tol)
  np.testing.assert_allclose(ref.host(g_query), ref.host(want_query), **tol)


@pytest.mark.parametrize("vocab", [99, 104])
def test_vocab_parallel_step_lowers_for_cuda(vocab):
  """Ahead of time, on an abstract H200 mesh: the loss's step builds for GPU.

  The collectives its shard_maps write are all-reduces only (the loss's
  per-token numbers, the table's data-parallel gradient); without
  ``out_sharding``, attend's own all-gather of the logits would show here.
  """
  from embedlib.kernels import lowering

  mesh = lowering.gpu_abstract_mesh((2, 4), ("data", "model"))
  with lowering.lowering_context(mesh):
    emb = nnx.eval_shape(lambda: embedlib.ShardedEmbed(
        vocab, ref.FEATURES, mesh=mesh, sharding="vocab", rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(emb)
  state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  split = NamedSharding(mesh, P("data"))
  query = jax.ShapeDtypeStruct((ref.TOKENS, ref.FEATURES), jnp.float32, sharding=split)
  labels = jax.ShapeDtypeStruct((ref.TOKENS,), jnp.int32, sharding=split)

  def step(s, q, y):
    def loss(s, q):
      logits = nnx.merge(graphdef, s).attend(q, out_sharding=P("data", "model"))
      return embedlib.vocab_parallel_cross_entropy(logits, y, reduction="mean")

    return jax.value_and_grad(loss, argnums=(0, 1))(s, q)

  text = lowering.cuda_lowering_text(step, state, query, labels, mesh=mesh)
  assert "all_reduce" in text
  assert "all_gather" not in text and "all_to_all" not in text
