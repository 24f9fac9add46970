"""A quantized DLRM scores as its float twin does, and near the float model.

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
from tests.quant.twin import quantized_and_twin


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
