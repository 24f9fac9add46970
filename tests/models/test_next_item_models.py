"""SASRec and HSTU: causal (a later item changes no earlier output), padding, time bias, dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embedlib.embed import ShardedEmbed
from embedlib.models import HSTU, SASRec
from embedlib.models.blocks import RowDropout

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
