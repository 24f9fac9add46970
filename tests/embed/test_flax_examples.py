"""Flax's LLM examples train identically with ShardedEmbed on their 2-D layout.

Two tiny models, written the way flax's examples write theirs, each built
twice from the same rngs: with ``nnx.Embed`` and with ``embedlib.ShardedEmbed``
swapped in, same annotation, nothing else changed. One ``nnx.jit`` AdamW step
each (``nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)``) with a
cross-entropy loss on tied logits must give the same loss and the same
updated parameters (1e-5), with the table planned as a ``"grid"`` (rows over
'tensor', columns over 'fsdp') and still split 8 ways after the step.

- google/flax ``examples/gemma`` at 0.12.8 (commit 3a491108): ``ScaledEmbed``
  (``nnx.Embed`` whose lookup is scaled by ``sqrt(embed_dim)``) built with
  ``embedding_metadata={'out_sharding': shd_config.emb_vd}``, where train.py
  takes ``ShardingConfig.fsdp_tp_sharding(fsdp_axis_name='fsdp',
  tensor_parallel_axis_name='tensor')`` (``emb_vd=P('tensor', 'fsdp')``) on
  ``jax.make_mesh`` (Explicit axes) under ``jax.set_mesh``; encode and
  ``attend`` pass ``out_sharding=shd_config.act_btd``, the feed-forward
  ``nnx.Linear`` s carry ``kernel_metadata``. Decoding is ``attend`` (as at
  3a491108) or ``x @ table.T`` on the parameter (as its ``Embedder.decode``
  did before commit 5260a1ed).
- google/flax ``examples/lm1b_nnx`` before its deletion (commit 881b8ed4^):
  the decoder's ``nnx.Embed`` built with ``embedding_init=nnx.with_partitioning(
  normal(1.0), config.axis_rules('vocab', 'embed'))``, its ``MeshRules(embed=
  'fsdp', vocab='tensor', mlp='tensor')`` on mesh axes ``('data', 'fsdp',
  'tensor')``, and tied logits ``attend(y) / sqrt(emb_dim)``
  (``logits_via_embedding``); also with logical names under
  ``nnx.logical_axis_rules`` and on Auto axes.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import embedlib
from embedlib import axes
from tests.embed.contract import make_mesh

FSDP, TENSOR, DATA = axes.FSDP, axes.TENSOR, axes.DATA  # the examples' mesh axis names
VOCAB = 96  # divides the 4 row ranks: the parameter is the logical table
UNEVEN_VOCAB = 99  # padded to 100 rows
EMBED, HIDDEN = 16, 32
BATCH, SEQ = 8, 4
TOL = 1e-5


def mesh_2d(axis_types=AxisType.Explicit):
  """flax gemma train.py: ``jax.make_mesh`` of fsdp=2 x tensor=4 (Explicit by default)."""
  return make_mesh((2, 4), (FSDP, TENSOR), axis_types=(axis_types,) * 2)


def mesh_3d(axis_types):
  """flax lm1b_nnx: mesh axes ('data', 'fsdp', 'tensor'), here 1 x 2 x 4."""
  return make_mesh((1, 2, 4), (DATA, FSDP, TENSOR), axis_types=(axis_types,) * 3)


# -- flax examples/gemma (3a491108) ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """The fields of gemma's ``transformer_cfg.ShardingConfig`` this model reads."""

  emb_vd: P | None = None
  ffw_weight_df: P | None = None
  ffw_weight_fd: P | None = None
  act_btd: P | None = None
  act_btf: P | None = None

  @staticmethod
  def fsdp_tp_sharding(fsdp_axis_name="fsdp", tensor_parallel_axis_name="tp"):
    fsdp, tp = fsdp_axis_name, tensor_parallel_axis_name
    return ShardingConfig(
        emb_vd=P(tp, fsdp), ffw_weight_df=P(fsdp, tp), ffw_weight_fd=P(tp, fsdp),
        act_btd=P(fsdp, None, tp), act_btf=P(fsdp, None, tp))


def scaled_embed(base):
  """Gemma's ``ScaledEmbed``, on ``nnx.Embed`` or on ``ShardedEmbed``."""

  class ScaledEmbed(base):
    def __call__(self, x, out_sharding=None):
      x = super().__call__(x, out_sharding)
      x *= jnp.sqrt(x.shape[-1])
      return x

  return ScaledEmbed


class GemmaLM(nnx.Module):
  """Embedder, one gated feed-forward block, tied logits."""

  def __init__(self, embed_base, num_embed, shd_config, *, decode="attend", rngs):
    self.shd_config = shd_config
    self.decode = decode
    self.embedder = scaled_embed(embed_base)(
        num_embed, EMBED, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs,
        embedding_metadata={"out_sharding": shd_config.emb_vd})
    linear = lambda i, o, spec: nnx.Linear(  # noqa: E731
        i, o, use_bias=False, kernel_init=nnx.initializers.normal(),
        kernel_metadata={"out_sharding": spec}, rngs=rngs)
    self.gate_proj = linear(EMBED, HIDDEN, shd_config.ffw_weight_df)
    self.up_proj = linear(EMBED, HIDDEN, shd_config.ffw_weight_df)
    self.down_proj = linear(HIDDEN, EMBED, shd_config.ffw_weight_fd)

  def __call__(self, tokens):
    shd = self.shd_config
    x = self.embedder(tokens, out_sharding=shd.act_btd)
    h = nnx.gelu(self.gate_proj(x, out_sharding=shd.act_btf))
    h = h * self.up_proj(x, out_sharding=shd.act_btf)
    x = x + self.down_proj(h, out_sharding=shd.act_btd)
    if self.decode == "attend":
      return self.embedder.attend(x, out_sharding=shd.act_btd)
    table = self.embedder.embedding[...]  # Embedder.decode, before 5260a1ed
    if shd.emb_vd is not None:
      # On Explicit axes the contracted features must be split alike (x's
      # are over 'tensor', the table's over 'fsdp': a sharding type error for
      # either class): gather the table and x's features.
      table = jax.sharding.reshard(table, P())
      x = jax.sharding.reshard(x, P(shd.act_btd[0], None, None))
    return x @ table.T


def gemma_loss(logits, targets):
  """gemma train.py's cross-entropy (one-hot targets, no smoothing), mean over tokens."""
  soft_targets = jax.nn.one_hot(targets, logits.shape[-1])
  return -jnp.sum(soft_targets * nnx.log_softmax(logits), axis=-1).mean()


# -- flax examples/lm1b_nnx (881b8ed4^) -----------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshRules:
  """lm1b_nnx's ``configs/default.MeshRules``: logical names to mesh axes."""

  embed: str | None = None
  mlp: str | None = None
  vocab: str | None = None

  def __call__(self, *keys):
    return tuple(getattr(self, key) for key in keys)


LM1B_RULES = MeshRules(embed=FSDP, mlp=TENSOR, vocab=TENSOR)
LOGICAL_NAMES = lambda *names: names  # noqa: E731  mapped by nnx.logical_axis_rules
LOGICAL_RULES = (("vocab", TENSOR), ("embed", FSDP), ("mlp", TENSOR))


class Lm1bDecoder(nnx.Module):
  """Shared embedding, LayerNorm + MlpBlock, ``logits_via_embedding``."""

  def __init__(self, embed_cls, vocab, axis_rules, *, rngs):
    self.output_embed = embed_cls(
        num_embeddings=vocab, features=EMBED,
        embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(stddev=1.0), axis_rules("vocab", "embed")),
        rngs=rngs)
    self.norm = nnx.LayerNorm(
        EMBED,
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axis_rules("embed")),
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), axis_rules("embed")),
        rngs=rngs)
    self.linear1 = nnx.Linear(
        EMBED, HIDDEN,
        kernel_init=nnx.with_partitioning(
            nnx.initializers.xavier_uniform(), axis_rules("embed", "mlp")),
        bias_init=nnx.with_partitioning(nnx.initializers.normal(1e-6), axis_rules("mlp")),
        rngs=rngs)
    self.linear2 = nnx.Linear(
        HIDDEN, EMBED,
        kernel_init=nnx.with_partitioning(
            nnx.initializers.xavier_uniform(), axis_rules("mlp", "embed")),
        bias_init=nnx.with_partitioning(nnx.initializers.normal(1e-6), axis_rules("embed")),
        rngs=rngs)

  def __call__(self, tokens):
    y = self.output_embed(tokens)
    y = y + self.linear2(nnx.relu(self.linear1(self.norm(y))))
    logits = self.output_embed.attend(y.astype(jnp.float32))
    return logits / jnp.sqrt(y.shape[-1])


def lm1b_loss(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# -- one AdamW step on both models ----------------------------------------------


def _embed(model):
  return model.embedder if isinstance(model, GemmaLM) else model.output_embed


def _logical(emb):
  if isinstance(emb, embedlib.ShardedEmbed):
    return np.asarray(emb.logical_table(replicated=True))
  return np.asarray(emb.embedding[...])


def _others(model):
  """Every parameter but the table, by path."""
  return {"/".join(map(str, k)): np.asarray(v[...])
          for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
          if "embedder" not in k and "output_embed" not in k}


@dataclasses.dataclass
class Step:
  sharded: nnx.Module
  reference: nnx.Module
  initial: dict  # tables and other parameters before the step
  losses: tuple  # (sharded, reference)


def _train_step(loss_fn):
  @nnx.jit
  def train_step(model, optimizer, tokens, targets):
    def loss(m):
      return loss_fn(m(tokens), targets)

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value

  return train_step


def _tokens(vocab, mesh, data_sharding):
  """Tokens and next-token targets, the batch split over the example's data axes."""
  seq = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (BATCH, SEQ + 1)), jnp.int32)
  if mesh is not None:
    seq = jax.device_put(seq, jax.NamedSharding(mesh, P(data_sharding)))
  return seq[:, :-1], seq[:, 1:]


def _on(mesh, rules=()):
  """The example's context: ``jax.set_mesh(mesh)`` (none for one device) and axis rules."""
  stack = contextlib.ExitStack()
  if mesh is not None:
    stack.enter_context(jax.set_mesh(mesh))
  stack.enter_context(nnx.logical_axis_rules(rules))
  return stack


def run_step(mesh, build, loss_fn, vocab, data_sharding, rules=(), reference=None):
  """Builds both models, aligns their tables, runs one AdamW step each.

  ``reference``: None builds the ``nnx.Embed`` model the same way on
  ``mesh``; else that build, on one device.
  """
  step = _train_step(loss_fn)
  with _on(mesh, rules):
    sharded = build(embedlib.ShardedEmbed, nnx.Rngs(0))
  ref_mesh, ref_build = (mesh, build) if reference is None else (None, reference)
  with _on(ref_mesh, rules):
    ref = ref_build(nnx.Embed, nnx.Rngs(0))
  initial = {"sharded_table": _logical(_embed(sharded)),
             "reference_table": _logical(_embed(ref)),
             "sharded": _others(sharded), "reference": _others(ref)}
  losses = []
  for model, on in ((sharded, mesh), (ref, ref_mesh)):
    with _on(on, rules):
      if model is sharded:  # the same start even if the draws differed (test_same_draws)
        _embed(sharded).load_table(initial["reference_table"])
      optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
      losses.append(float(step(model, optimizer, *_tokens(vocab, on, data_sharding))))
  return Step(sharded, ref, initial, tuple(losses))


def gemma(decode="attend", vocab=VOCAB):
  shd_config = ShardingConfig.fsdp_tp_sharding(fsdp_axis_name=FSDP, tensor_parallel_axis_name=TENSOR)
  return lambda embed, rngs: GemmaLM(embed, vocab, shd_config, decode=decode, rngs=rngs)


def lm1b(axis_rules, vocab=VOCAB):
  return lambda embed, rngs: Lm1bDecoder(embed, vocab, axis_rules, rngs=rngs)


CASES = {
    "gemma-attend": lambda: run_step(mesh_2d(), gemma("attend"), gemma_loss, VOCAB, FSDP),
    "gemma-table-T": lambda: run_step(mesh_2d(), gemma("matmul"), gemma_loss, VOCAB, FSDP),
    # lm1b's train.py builds `Mesh(devices, axes)`: Auto axes (its layers
    # aren't written for Explicit ones: nnx.Linear's contraction over 'fsdp'
    # is a sharding type error there, whichever embedding class).
    "lm1b-mesh-rules-auto": lambda: run_step(
        mesh_3d(AxisType.Auto), lm1b(LM1B_RULES), lm1b_loss, VOCAB, DATA),
    "lm1b-logical-auto": lambda: run_step(
        mesh_3d(AxisType.Auto), lm1b(LOGICAL_NAMES), lm1b_loss, VOCAB, DATA, LOGICAL_RULES),
}


@pytest.fixture(scope="module", params=list(CASES))
def step(request):
  return CASES[request.param]()


def test_same_draws(step):
  np.testing.assert_array_equal(step.initial["sharded_table"], step.initial["reference_table"])
  assert step.initial["sharded"].keys() == step.initial["reference"].keys()
  for k, v in step.initial["reference"].items():
    np.testing.assert_array_equal(step.initial["sharded"][k], v, err_msg=k)


def test_grid_plan_over_8_devices(step):
  plan = _embed(step.sharded).plan
  assert plan.strategy == "grid"
  assert plan.table_axes == (TENSOR,) and plan.column_axes == (FSDP,)
  assert (plan.group_size, plan.column_group_size) == (4, 2)


def test_same_loss_and_update(step):
  got, want = step.losses
  assert np.isfinite(want)
  np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
  before = step.initial["reference_table"]
  after = _logical(_embed(step.reference))
  assert np.abs(after - before).max() > 1e-4  # the step moved the table
  np.testing.assert_allclose(_logical(_embed(step.sharded)), after, rtol=TOL, atol=TOL)
  got, want = _others(step.sharded), _others(step.reference)
  for k, v in want.items():
    np.testing.assert_allclose(got[k], v, rtol=TOL, atol=TOL, err_msg=k)


def test_table_stays_split_8_ways(step):
  table = _embed(step.sharded).embedding[...]
  assert tuple(table.sharding.spec)[:2] == (TENSOR, FSDP)
  shards = table.addressable_shards
  assert len(shards) == 8
  assert {s.data.shape for s in shards} == {(VOCAB // 4, EMBED // 2)}
  blocks = {tuple((sl.start, sl.stop) for sl in s.index) for s in shards}
  assert len(blocks) == 8


def test_uneven_vocab_reading_the_parameter():
  """Gemma's ``x @ table.T`` decode with a vocabulary the 4 row ranks don't divide.

  ``embedding[...]`` is the logical table: exactly 99 logits, no padded one
  in the softmax.

  The reference is the unannotated model on one device: ``nnx.Embed`` can't
  be built with 99 rows over 4 ranks on Explicit axes (jax can't split an
  array unevenly: "does not evenly divide the dimension size 99").
  """
  no_sharding = lambda embed, rngs: GemmaLM(  # noqa: E731
      embed, UNEVEN_VOCAB, ShardingConfig(), decode="matmul", rngs=rngs)
  got = run_step(mesh_2d(), gemma("matmul", UNEVEN_VOCAB), gemma_loss, UNEVEN_VOCAB, FSDP,
                 reference=no_sharding)
  assert _embed(got.sharded).plan.strategy == "grid"
  np.testing.assert_allclose(got.losses[0], got.losses[1], rtol=TOL, atol=TOL)
  np.testing.assert_allclose(
      _logical(_embed(got.sharded)), _logical(_embed(got.reference)), rtol=TOL, atol=TOL)
