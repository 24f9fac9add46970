"""The quantized gather, bag and attend compile for H100 / H200, without one.

One program per format: a gather and a weighted mean bag of a quantized
table, with ``kernel="pallas"`` (the Triton kernels on CUDA: Mosaic GPU has
no quantized kernel of its own); then a quantized module's lookups in four
layouts, the kernels inside each layout's ``shard_map`` with its collectives;
then a tied quantized table's logits (``attend``: the codes' products,
`embedlib.quant.scores`), in two layouts.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import embedlib
from embedlib.kernels import deviceless
from embedlib.quant import format as fmt
from embedlib.quant import lookup
from tests.embed.test_gpu_lowering import CASES
from tests.gpu_compile import compiled
from tests.gpu_compile.test_strategies import OPCODES

S = jax.ShapeDtypeStruct


def _lookups(table, ids, bag_ids, weights):
  rows = lookup.gather(table, ids, kernel="pallas", interpret=False)
  bags = lookup.bag(table, bag_ids, weights, combiner="mean", kernel="pallas", interpret=False)
  return rows.sum() + (bags ** 2).sum()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("bits, target", [(8, "H100"), (4, "H200"), ("fp8", "H100"),
                                         ("bf16", "H200")])
def test_quantized_lookups_compile(bits, target):
  mesh = deviceless.gpu_mesh((1,), ("x",), target=target)
  rep = NamedSharding(mesh, P())
  shapes = jax.eval_shape(lambda t: fmt.quantize_table(t, bits, blocks=2),
                          S((1000, 192), jnp.float32))
  table = jax.tree.map(lambda s: S(s.shape, s.dtype, sharding=rep), shapes)
  args = (table, S((512,), jnp.int32, sharding=rep), S((64, 8), jnp.int32, sharding=rep),
          S((64, 8), jnp.float32, sharding=rep))
  program = compiled.compile_checked(f"quantized {bits}", _lookups, *args, mesh=mesh,
                                     target=target)
  compiled.check_all(program)
  # The compiled Triton kernels, named by their pallas_call.
  assert "embedlib_quantized_gather" in program.text
  assert "embedlib_quantized_bag" in program.text


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("case, bits", [("vocab-tokens", 8), ("hidden-tp", 4),
                                        ("routed-tokens", "fp8"), ("grid-fsdp-tp", 4)])
def test_quantized_layouts_compile(case, bits):
  """A quantized table's lookup and bag in a layout: the Triton kernels inside its shard_map."""
  shape, names, strategy, table_axes, _, collectives = CASES[case]
  mesh = deviceless.gpu_mesh(shape, names, target="H100")
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    emb = nnx.eval_shape(lambda: embedlib.ShardedEmbed(
        1000, 256, mesh=mesh, sharding=strategy, table_axes=table_axes, kernel="auto",
        rngs=nnx.Rngs(0)))
  # Quantized outside eval_shape, which would flatten the QuantizedTable to one leaf.
  emb = embedlib.quantize(emb, bits)
  assert emb.physical_table().data.sharding.spec == P(*emb.plan.table_spec)
  graphdef, state = nnx.split(emb)
  ids = S((64, 4), jnp.int32, sharding=NamedSharding(mesh, P(emb.plan.data_axes or None)))

  def lookups(s, i):
    m = nnx.merge(graphdef, s)
    return m(i), m.bag(i, combiner="mean")

  program = compiled.compile_checked(f"quantized {case}", lookups, state, ids, mesh=mesh)
  compiled.check_all(program, collectives_=[OPCODES[c] for c in collectives
                                            if c != "reduce_scatter" or strategy != "routed"])
  assert "embedlib_quantized_gather" in program.text
  assert "embedlib_quantized_bag" in program.text


@pytest.mark.parametrize("case, bits, rows", [("vocab-tokens", 8, 1_000_000),
                                              ("grid-fsdp-tp", 4, 1000)])
def test_quantized_attend_compiles(case, bits, rows):
  """A tied quantized table's logits: each shard's code products (`quant.scores`) in its layout.

  A million rows over 8 give shards of 125,000 rows, scored in chunks (a
  loop); the int4 grid scores its nibbles in one product and sums partial
  logits over its column group.
  """
  shape, names, strategy, table_axes, _, _ = CASES[case]
  mesh = deviceless.gpu_mesh(shape, names, target="H200")
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    emb = nnx.eval_shape(lambda: embedlib.ShardedEmbed(
        rows, 256, mesh=mesh, sharding=strategy, table_axes=table_axes, tied=True,
        rngs=nnx.Rngs(0)))
  emb = embedlib.quantize(emb, bits)
  graphdef, state = nnx.split(emb)
  query = S((64, 256), jnp.float32, sharding=NamedSharding(mesh, P(emb.plan.data_axes or None)))

  def logits(s, q):
    return nnx.merge(graphdef, s).attend(q)

  program = compiled.compile_checked(f"quantized attend {case}", logits, state, query, mesh=mesh,
                                     target="H200")
  compiled.check_all(program)
  assert ("while" in program.text) == (rows > 1000)  # the row chunks' loop
