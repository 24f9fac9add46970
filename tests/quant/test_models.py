"""A quantized DLRM scores as its float twin does, and near the float model; so does SASRec.

Tolerance: int8 rows are within half a step of the float rows (about 1/510
of each row's range); through the small MLPs here the logits move by far
less than 0.05, and int4 (1/30 of the range) by less than 0.3. (fp8 and
bf16 take the same path: `tests/quant/test_layouts.py` covers their kernels.)
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib.collection import FeatureSpec, TableSpec
from embedlib.models.dlrm import DLRM
from embedlib.models.sasrec import SASRec
from tests.quant.twin import attend_bound, quantized_and_twin


def _model():
  return DLRM(
      num_dense=3,
      tables=[TableSpec("a", 20, 8), TableSpec("b", 10, 8)],
      features=[FeatureSpec("a", "a", max_ids_per_sample=1), FeatureSpec("b", "b")],
      bottom_sizes=(16, 8), top_sizes=(16, 1), interaction="dot", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("bits, tol", [(8, 0.05), (4, 0.3)])
def test_quantized_dlrm(bits, tol):
  model = _model()
  dense = jnp.linspace(-1, 1, 12).reshape(4, 3)
  sparse = {"a": jnp.array([0, 1, 19, -1]), "b": jnp.array([[1, 2], [3, -1], [-1, -1], [9, 9]])}
  want = model(dense, sparse)
  quantized, twin = quantized_and_twin(model, bits)
  assert sum(isinstance(m, embedlib.QuantizedEmbed) for _, m in nnx.iter_graph(quantized)) == 2
  got = quantized(dense, sparse)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(twin(dense, sparse)))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol)
  assert not np.array_equal(np.asarray(got), np.asarray(want))


def test_quantized_sasrec_scores_through_its_tied_table():
  """The item table quantized serves the lookups and the logits (``attend``) alike."""
  items = embedlib.ShardedEmbed(21, 8, tied=True, name="item", rngs=nnx.Rngs(0))
  model = SASRec(items, max_len=5, num_layers=1, num_heads=2, repeat_bias=True, rngs=nnx.Rngs(0))
  model.embed.repeat_bias[...] = -0.1
  batch = {"items": jnp.array([[0, 0, 4, 9, 2], [1, 2, 3, 4, 20]])}
  quantized, twin = quantized_and_twin(model, 8)
  assert isinstance(quantized.items, embedlib.QuantizedEmbed)
  run = nnx.jit(lambda m, b: (m(b)[:, -1], m.logits(m(b)[:, -1], b["items"])))
  (hidden, got), (twin_hidden, want) = run(quantized, batch), run(twin, batch)
  np.testing.assert_array_equal(np.asarray(hidden), np.asarray(twin_hidden))  # lookups: exact
  assert (np.abs(np.asarray(got - want)) <= attend_bound(quantized.items, hidden)).all()
  assert not np.array_equal(np.asarray(got), np.asarray(run(model, batch)[1]))
  kept = embedlib.quantize(nnx.clone(model), 8, skip=("item",))
  assert type(kept.items) is embedlib.ShardedEmbed  # skip= leaves a table float
