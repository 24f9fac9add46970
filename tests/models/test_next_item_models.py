"""SASRec and HSTU: causal (a later item changes no earlier output), padding, time bias,
dropout, and the repeat bias (on exactly the items each position has read, on a split
vocabulary as on one device, its sign learned from the data)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import optax

from embedlib.embed import ShardedEmbed
from embedlib.logits import VocabShardedLogits
from embedlib.models import HSTU, SASRec
from embedlib.models.blocks import RowDropout
from embedlib.models.next_item import NextItemEmbed
from tests.embed.contract import build, make_mesh

L, V, W = 6, 20, 8
BATCH = {
    "items": jnp.array([[0, 0, 3, 7, 2, 9], [4, 5, 6, 7, 8, 1]]),
    "times": jnp.array([[0, 0, 10, 50, 900, 4000], [0, 1, 2, 3, 4, 5]]),
    "query_times": jnp.array([[0, 0, 50, 900, 4000, 90000], [1, 2, 3, 4, 5, 6]]),
}


def _model(name):
  items = ShardedEmbed(V, W, rngs=nnx.Rngs(0))
  if name == "sasrec":
    return SASRec(items, max_len=L, num_layers=2, num_heads=2, rngs=nnx.Rngs(1))
  model = HSTU(items, max_len=L, num_layers=2, num_heads=2, num_time_buckets=64,
               rngs=nnx.Rngs(1))
  for layer in model.layers:  # drawn at 0.02, the biases would barely move an output
    layer.time_bias[...] = jax.random.normal(jax.random.key(2), layer.time_bias.shape)
  return model


_MODELS = {}


def _built(name):
  """Each model and its jitted call, built once for the module."""
  if name not in _MODELS:
    _MODELS[name] = name, _model(name), nnx.jit(lambda m, b: m(b))
  return _MODELS[name]


@pytest.fixture(params=["sasrec", "hstu"])
def model(request):
  return _built(request.param)


def _with(key, row, col, value):
  batch = dict(BATCH)
  batch[key] = BATCH[key].at[row, col].set(value)
  return batch


def test_a_later_item_changes_no_earlier_output(model):
  _, m, run = model
  base = np.asarray(run(m, BATCH))
  for col in (3, 5):
    changed = np.asarray(run(m, _with("items", 1, col, 11)))
    np.testing.assert_array_equal(changed[:, :col], base[:, :col])
    np.testing.assert_array_equal(changed[0], base[0])
    assert np.abs(changed[1, col:] - base[1, col:]).max(axis=-1).min() > 1e-4


def test_left_padding_is_never_read(model):
  _, m, run = model
  # Another padded position's time or a padding row's content can't change a real output.
  base = np.asarray(run(m, BATCH))
  moved = np.asarray(run(m, _with("times", 0, 0, 777)))
  np.testing.assert_array_equal(moved[0, 2:], base[0, 2:])


def test_hstu_reads_the_time_gaps_causally():
  _, m, run = _built("hstu")
  base = np.asarray(run(m, BATCH))
  # The gap to what position 3 predicts: position 3's output and later ones change, not earlier.
  later = np.asarray(run(m, _with("query_times", 0, 3, 10**7)))
  np.testing.assert_array_equal(later[0, :3], base[0, :3])
  assert np.abs(later[0, 3] - base[0, 3]).max() > 1e-4
  # The same items at the same gaps, shifted in absolute time: the same outputs.
  shifted = {k: v + jnp.where(BATCH["items"] > 0, 10**6, 0) if k != "items" else v
             for k, v in BATCH.items()}
  np.testing.assert_allclose(np.asarray(run(m, shifted))[:, 2:], base[:, 2:], rtol=1e-5,
                             atol=1e-6)
  # Without its time bias (all buckets weighted alike), HSTU ignores the gaps.
  m = _model("hstu")
  for layer in m.layers:
    layer.time_bias[...] = jnp.zeros_like(layer.time_bias[...])
  flat = np.asarray(run(m, BATCH))
  np.testing.assert_allclose(np.asarray(run(m, _with("query_times", 0, 3, 10**7))), flat,
                             rtol=1e-6, atol=1e-6)


def test_dropout_is_a_function_of_the_row_seeds():
  _, m, _ = _built("sasrec")  # both models draw their masks through RowDropout
  run = nnx.jit(lambda m, b, seeds: m(b, RowDropout(seeds, 0.5)))
  seeds = jnp.array([5, 6], jnp.uint32)
  first, again = run(m, BATCH, seeds), run(m, BATCH, seeds)
  np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
  other = run(m, BATCH, jnp.array([5, 7], jnp.uint32))
  np.testing.assert_array_equal(np.asarray(other[0]), np.asarray(first[0]))
  assert not np.allclose(np.asarray(other[1]), np.asarray(first[1]))


def _seen_reference(items, vocab):
  """Position by position, the real items read so far: numpy bool ``[B, L, vocab]``."""
  items = np.asarray(items)
  seen = np.zeros(items.shape + (vocab,), bool)
  for b, row in enumerate(items):
    for t in range(len(row)):
      for item in row[: t + 1]:
        if item > 0:
          seen[b, t, item] = True
  return seen


def _embed(table, repeat_bias=True, max_len=L):
  embed = NextItemEmbed(table, max_len=max_len, repeat_bias=repeat_bias, rngs=nnx.Rngs(0))
  if repeat_bias:
    embed.repeat_bias[...] = jnp.float32(0.25)  # a logit of 2.5
  return embed


def test_the_repeat_bias_lifts_exactly_the_items_each_position_has_read():
  embed = _embed(ShardedEmbed(V, W, rngs=nnx.Rngs(0)))
  hidden = jax.random.normal(jax.random.key(3), (2, L, W))
  plain = np.asarray(embed.items.attend(hidden))
  seen = _seen_reference(BATCH["items"], V)
  np.testing.assert_allclose(np.asarray(embed.logits(hidden, BATCH["items"])),
                             plain + 2.5 * seen, rtol=1e-6, atol=1e-6)
  # One vector per row (the last position's) takes every item of the row.
  np.testing.assert_allclose(np.asarray(embed.logits(hidden[:, -1], BATCH["items"])),
                             plain[:, -1] + 2.5 * seen[:, -1], rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match=r"pass the rows' input items"):
    embed.logits(hidden)
  with pytest.raises(ValueError, match=r"don't match"):
    embed.logits(hidden[:, :3], BATCH["items"])
  # Without the bias the model has no such parameter and takes no items.
  off = _embed(embed.items, repeat_bias=False)
  assert off.repeat_bias is None
  np.testing.assert_array_equal(np.asarray(off.logits(hidden, BATCH["items"])), plain)


@pytest.mark.parametrize("vocab", [24, 21])  # divides the 4 devices; doesn't (padded)
def test_the_repeat_bias_on_a_split_vocabulary_equals_one_device(vocab):
  table = build(vocab, W, make_mesh((4,), ("model",)), sharding="vocab")
  embed = _embed(table)
  hidden = jax.random.normal(jax.random.key(4), (2, L, W))
  items = BATCH["items"].at[1, 0].set(vocab - 1)  # a row in the last block
  logits = embed.logits(hidden, items, vocab_split=True)
  assert isinstance(logits, VocabShardedLogits) == (vocab % 4 != 0)
  logical = logits.unpadded() if isinstance(logits, VocabShardedLogits) else logits
  expected = np.asarray(table.attend(hidden)) + 2.5 * _seen_reference(items, vocab)
  np.testing.assert_allclose(np.asarray(logical), expected, rtol=1e-5, atol=1e-5)


def _planted_rows(rng, repeat, rows=32, vocab=V, length=L):
  """Rows of distinct items; each position's target is an item it has read (``repeat``) or
  the row's next, unread item."""
  items = np.stack([rng.permutation(np.arange(1, vocab))[: length + 1] for _ in range(rows)])
  if repeat:
    earlier = rng.integers(0, np.arange(1, length + 1), size=(rows, length))
    targets = np.take_along_axis(items[:, :length], earlier, axis=1)
  else:
    targets = items[:, 1:]
  return {"items": jnp.asarray(items[:, :length], jnp.int32)}, jnp.asarray(targets, jnp.int32)


def test_the_repeat_bias_learns_its_sign_from_the_data():
  """Rows whose next item is one they hold lift the bias; rows of new items lower it."""
  @nnx.jit
  def step(model, optimizer, batch, targets):
    def loss(model):
      logits = model.logits(model(batch), batch["items"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    optimizer.update(model, nnx.grad(loss)(model))

  learned = {}
  for repeat in (True, False):
    items = ShardedEmbed(V, W, rngs=nnx.Rngs(0))
    model = SASRec(items, max_len=L, num_layers=1, num_heads=2, repeat_bias=True,
                   rngs=nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    for _ in range(15):
      step(model, optimizer, *_planted_rows(rng, repeat))
    learned[repeat] = model.embed.repeat_logit
  assert learned[True] > 0.5 and learned[False] < -0.5, learned
