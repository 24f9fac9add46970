"""Flax code written for nnx.Embed runs unchanged with ShardedEmbed, its annotations read.

The models below are written the way flax's examples write them: Gemma's
``ScaledEmbed(nnx.Embed)`` built with ``embedding_metadata={'out_sharding':
config.shd_config.emb_vd}`` and tied logits, and lm1b's decoder built with
``embedding_init=nnx.with_partitioning(init, config.axis_rules('vocab',
'embed'))`` beside a partitioned ``nnx.Linear``. Each is built twice, with
``nnx.Embed`` on one device (the reference) and with ``ShardedEmbed`` swapped
in on a 2 x 4 mesh: logits are equal (lookups copy rows; the tied logits'
sums run in another order, rtol 1e-5) and so are the gradients.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import embedlib
from tests.embed.contract import make_mesh
from tests.embed.test_flax_examples import scaled_embed

FEATURES = 16


def mesh(axis_types=AxisType.Auto):
  return make_mesh((2, 4), ("data", "model"), axis_types=(axis_types,) * 2)


# -- flax's Gemma example, base class switchable -------------------------------


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  emb_vd: P | None = None


class TinyGemma(nnx.Module):
  def __init__(self, embed_base, vocab, shd_config, *, rngs):
    self.embedder = scaled_embed(embed_base)(
        vocab, FEATURES, rngs=rngs, embedding_metadata={"out_sharding": shd_config.emb_vd})
    self.mlp = nnx.Linear(FEATURES, FEATURES, rngs=rngs)

  def __call__(self, tokens):
    x = self.embedder(tokens)
    x = x + jax.nn.gelu(self.mlp(x))
    return self.embedder.attend(x)


# -- flax's lm1b NNX example, embedding class switchable ------------------------


@dataclasses.dataclass(frozen=True)
class MeshRules:
  embed: str | None = None
  vocab: str | None = None

  def __call__(self, *keys):
    return tuple(getattr(self, k) for k in keys)


class Decoder(nnx.Module):
  def __init__(self, embed_cls, vocab, axis_rules, *, rngs):
    self.output_embed = embed_cls(
        num_embeddings=vocab, features=FEATURES,
        embedding_init=nnx.with_partitioning(nnx.initializers.normal(stddev=1.0),
                                             axis_rules("vocab", "embed")),
        rngs=rngs)
    self.norm = nnx.LayerNorm(FEATURES, rngs=rngs)
    self.logitdense = nnx.Linear(
        FEATURES, vocab, kernel_init=nnx.with_partitioning(
            nnx.initializers.xavier_uniform(), axis_rules("embed", "vocab")), rngs=rngs)

  def __call__(self, tokens):
    return self.logitdense(self.norm(self.output_embed(tokens)))


LOGICAL = lambda *names: names  # noqa: E731  logical names, mapped by the rules


def _tokens(vocab):
  return jnp.asarray(np.random.default_rng(0).integers(0, vocab, (4, 6)), jnp.int32)


# One program per model (op by op, each primitive would compile its own).
@nnx.jit
def _jit_logits_and_grads(model, tokens):
  def loss(m):
    logits = m(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean(), logits

  (_, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  return logits, grads


def _logits_and_grads(model, tokens):
  logits, grads = _jit_logits_and_grads(model, tokens)
  return np.asarray(logits), {"/".join(map(str, k)): np.asarray(v[...])
                              for k, v in nnx.to_flat_state(grads)}


def _assert_same(sharded, reference, tokens):
  got, got_grads = _logits_and_grads(sharded, tokens)
  want, want_grads = _logits_and_grads(reference, tokens)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert got_grads.keys() == want_grads.keys()
  for k, g in want_grads.items():
    logical = got_grads[k][tuple(slice(n) for n in g.shape)]  # padding cut off
    np.testing.assert_allclose(logical, g, rtol=1e-5, atol=1e-6, err_msg=k)


# Each annotation with a vocabulary that doesn't divide the shards (61: the
# padded table must never show), and the plain even case once. CI runs the
# uneven ones (test_lm1b_style_with_partitioning's vocabularies are all
# even); -m slow adds the even one.
@pytest.mark.parametrize("emb_vd, strategy, vocab", [
    (None, "replicated", 61), (P("model", None), "vocab", 61), (P(None, "model"), "hidden", 61),
    (P(("data", "model"), None), "vocab", 61), (P("model", "data"), "grid", 61),
    pytest.param(P("model", None), "vocab", 64, marks=pytest.mark.slow)],
    ids=["none", "vocab", "hidden", "vocab-2-axes", "grid", "vocab-even"])
def test_gemma_style_metadata(emb_vd, strategy, vocab):
  m = mesh(AxisType.Explicit)
  with jax.set_mesh(m):
    sharded = TinyGemma(embedlib.ShardedEmbed, vocab, ShardingConfig(emb_vd), rngs=nnx.Rngs(0))
  with nnx.use_eager_sharding(False):
    reference = TinyGemma(nnx.Embed, vocab, ShardingConfig(emb_vd), rngs=nnx.Rngs(0))
  assert sharded.embedder.plan.strategy == strategy
  with jax.set_mesh(m):
    _assert_same(sharded, reference, _tokens(vocab))


# CI runs each way of naming the axes (mesh axes, logical rules) and each
# split (vocab, embed, both) once; -m slow adds mesh axes on embed and
# logical rules on vocab.
@pytest.mark.parametrize("axis_rules, rules", [
    (MeshRules(vocab="model"), ()),
    pytest.param(MeshRules(embed="model"), (), marks=pytest.mark.slow),
    pytest.param(LOGICAL, (("vocab", "model"), ("embed", None)), marks=pytest.mark.slow),
    (LOGICAL, (("vocab", None), ("embed", "model"))),
    (LOGICAL, (("vocab", "model"), ("embed", "data"))),
], ids=["mesh-axes-vocab", "mesh-axes-embed", "logical-vocab", "logical-embed", "logical-grid"])
def test_lm1b_style_with_partitioning(axis_rules, rules):
  vocab = 64  # flax lays the partitioned Linear out too: it must divide
  m = mesh()
  with jax.set_mesh(m), nnx.logical_axis_rules(rules):
    sharded = Decoder(embedlib.ShardedEmbed, vocab, axis_rules, rngs=nnx.Rngs(0))
    reference = Decoder(nnx.Embed, vocab, axis_rules, rngs=nnx.Rngs(0))
    split = {k for k, v in rules if v} or {k for k in ("vocab", "embed") if axis_rules(k)[0]}
    strategy = {frozenset({"vocab"}): "vocab", frozenset({"embed"}): "hidden",
                frozenset({"vocab", "embed"}): "grid"}[frozenset(split)]
    assert sharded.output_embed.plan.strategy == strategy
    assert sharded.output_embed.plan.table_axes == ("model",)
    _assert_same(sharded, reference, _tokens(vocab))


def test_flax_tools_read_the_physical_layout():
  m = mesh()
  with jax.set_mesh(m), nnx.logical_axis_rules((("vocab", "model"),)):
    emb = embedlib.ShardedEmbed(
        61, 8, rngs=nnx.Rngs(0),
        embedding_init=nnx.with_partitioning(nnx.initializers.normal(), ("vocab", None)))
  state = nnx.state(emb)
  assert emb.physical_table().shape == (64, 8)  # 61 rows padded to 4 ranks
  assert emb.embedding.out_sharding == (("model",), None)
  assert nnx.get_partition_spec(state)["embedding"].get_value() == P("model", None)
  named = nnx.get_named_sharding(state, m)["embedding"].get_value()
  assert named.is_equivalent_to(emb.physical_table().sharding, 2)


def _linen_leaf(cls, **kwargs):
  model = nnx.bridge.to_linen(cls, 64, FEATURES, **kwargs)
  ids = _tokens(64)
  with jax.set_mesh(mesh()):
    variables = model.init(jax.random.key(0), ids)
    out = model.apply(variables, ids)
  return variables["params"]["embedding"], np.asarray(out)


@pytest.mark.parametrize("annotation", [None, ("model", None)], ids=["plain", "partitioned"])
def test_linen_bridge_returns_what_nnx_embed_returns(annotation):
  kwargs = {}
  if annotation:
    kwargs["embedding_init"] = nnx.with_partitioning(nnx.initializers.normal(), annotation)
  ref, ref_out = _linen_leaf(nnx.Embed, **kwargs)
  got, got_out = _linen_leaf(embedlib.ShardedEmbed, sharding="vocab", **kwargs)
  assert type(got) is type(ref)
  np.testing.assert_array_equal(got_out, ref_out)
  if annotation:
    with jax.set_mesh(mesh()):  # nnx.Embed's box has no mesh of its own
      assert got.get_partition_spec() == ref.get_partition_spec() == P("model", None)
    got, ref = got.unbox(), ref.unbox()
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  assert got.sharding.spec == P("model", None)  # still split, boxed or not
  assert not isinstance(got, nn.meta.AxisMetadata)


def test_explicit_arguments_win_and_must_agree():
  m = mesh()
  kw = dict(mesh=m, rngs=nnx.Rngs(0))
  none = {"out_sharding": P()}
  assert embedlib.ShardedEmbed(64, 16, sharding="hidden", embedding_metadata=none,
                               **kw).plan.strategy == "hidden"
  vocab = {"out_sharding": P("model", None)}
  agree = embedlib.ShardedEmbed(64, 16, sharding="vocab", table_axes="model",
                                embedding_metadata=vocab, **kw)
  assert agree.plan.table_axes == ("model",)
  with pytest.raises(ValueError, match=r"t: sharding='hidden' contradicts embedding_metadata "
                                       r"out_sharding=.*asks for vocab sharding over \('model',\)"):
    embedlib.ShardedEmbed(64, 16, sharding="hidden", embedding_metadata=vocab, name="t", **kw)
  with pytest.raises(ValueError, match=r"table_axes=\('data',\) contradicts"):
    embedlib.ShardedEmbed(64, 16, table_axes=("data",), embedding_metadata=vocab, **kw)
  with pytest.raises(ValueError, match=r"sharding='replicated' contradicts embedding_init"):
    embedlib.ShardedEmbed(64, 16, sharding="replicated", **kw, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(), (None, "model")))


@pytest.mark.parametrize("metadata, rules, pattern", [
    (P("tensor", None), (), r"item: embedding_metadata out_sharding=.* puts axis 'tensor' on "
                            r"num_embeddings, which is neither an axis of the mesh \(its axes are "
                            r"\('data', 'model'\)\)"),
    (P("vocab", None), (("embed", "model"),), r"'vocab'.*rules: \(\('embed', 'model'\),\)"),
    (P("model", "model"), (), r"item: embedding_metadata out_sharding=.* puts mesh axis 'model' "
                              r"on num_embeddings \('model',\) and on features \('model',\)"),
    (P("vocab", "embed"), (("vocab", "model"), ("embed", "model")), r"mesh axis 'model' on"),
    (P(None, None, "model"), (), r"has 3 entries"),
])
def test_bad_annotations_are_named(metadata, rules, pattern):
  with nnx.logical_axis_rules(rules), pytest.raises(ValueError, match=pattern):
    embedlib.ShardedEmbed(64, 16, mesh=mesh(), name="item", rngs=nnx.Rngs(0),
                          embedding_metadata={"out_sharding": metadata})


def test_mesh_axes_without_a_mesh_are_named():
  with pytest.raises(ValueError, match=r"names mesh axis 'model' but there is no mesh"):
    embedlib.ShardedEmbed(64, 16, rngs=nnx.Rngs(0),
                          embedding_metadata={"out_sharding": P("model", None)})
  plain = embedlib.ShardedEmbed(64, 16, rngs=nnx.Rngs(0), embedding_metadata={"out_sharding": None})
  np.testing.assert_array_equal(plain.embedding[...], nnx.Embed(64, 16, rngs=nnx.Rngs(0)).embedding[...])
