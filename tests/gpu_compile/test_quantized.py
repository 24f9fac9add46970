"""The quantized gather and bag (`embedlib.quant.triton`) compile for an H100, without one.

One program per format: a gather and a weighted mean bag of a quantized
table, with ``kernel="pallas"`` (the Triton kernels on CUDA: Mosaic GPU has
no quantized kernel of its own).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from embedlib.kernels import deviceless
from embedlib.quant import format as fmt
from embedlib.quant import lookup
from tests.gpu_compile import compiled

S = jax.ShapeDtypeStruct


@pytest.fixture(scope="module")
def mesh():
  return deviceless.gpu_mesh((1,), ("x",), target="H100")


def _lookups(table, ids, bag_ids, weights):
  rows = lookup.gather(table, ids, kernel="pallas", interpret=False)
  bags = lookup.bag(table, bag_ids, weights, combiner="mean", kernel="pallas", interpret=False)
  return rows.sum() + (bags ** 2).sum()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("bits", fmt.FORMATS)
def test_quantized_lookups_compile(mesh, bits):
  rep = NamedSharding(mesh, P())
  shapes = jax.eval_shape(lambda t: fmt.quantize_table(t, bits, blocks=2),
                          S((1000, 192), jnp.float32))
  table = jax.tree.map(lambda s: S(s.shape, s.dtype, sharding=rep), shapes)
  args = (table, S((512,), jnp.int32, sharding=rep), S((64, 8), jnp.int32, sharding=rep),
          S((64, 8), jnp.float32, sharding=rep))
  program = compiled.compile_checked(f"quantized {bits}", _lookups, *args, mesh=mesh)
  compiled.check_all(program)
  # The compiled Triton kernels, named by their pallas_call.
  assert "embedlib_quantized_gather" in program.text
  assert "embedlib_quantized_bag" in program.text
