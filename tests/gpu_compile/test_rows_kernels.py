"""The many-rows-in-flight Triton kernels compile for sm_90a (H100 / H200), without a GPU, as designed.

Three programs: the float32 lookups (gather and weighted mean bag, each
with its segment-sum backward, through ``rows_ad``) beside the int8 and
int4 bags and gathers; the same float lookups in bfloat16; the fused update
of every rule on a table past 2**31 elements (64-bit offsets) beside a
gather of it. Each compiles through XLA, Triton and ptxas for sm_90a with
the suite's checks (``compiled.CHECK_OPTIONS``: a spill fails the
compile), and its PTX (``embedlib.kernels.ptx``) shows what the design
promises: every kernel there, no spills, and the table rows read with
16-byte ``ld.global.v4`` loads. ``python benchmarks/gpu_static.py`` prints
the same figures for every kernel, dtype and table.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from embedlib.kernels import deviceless, ptx, rows, rows_ad, update_rows
from embedlib.kernels.gather_rows import gather_rows
from embedlib.quant import bag_rows as quant_rows
from embedlib.quant import format as fmt
from tests.gpu_compile import compiled
from tests.kernels.test_large_tables import FEATURES, ROWS

pytestmark = [pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"),
              # The per-run vectors ride along in the donated update arguments.
              pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")]


@pytest.fixture(scope="module")
def mesh():
  return deviceless.gpu_mesh((1,), ("x",), target="H100")


def S(mesh, shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def lookups(dtype, width):
  """Gather and weighted mean bag by the rows kernels, and their backward: value and table gradient."""
  row_bytes = width * jnp.dtype(dtype).itemsize
  gather = rows.default_variant("gather", row_bytes).name
  bag = rows.default_variant("bag", row_bytes, 64).name
  segment = rows.default_variant("segment", row_bytes, itemsize=jnp.dtype(dtype).itemsize).name

  def loss(table, ids, bag_ids, weights):
    got = rows_ad.gather(table, ids, gather, segment, False)
    pooled = rows_ad.bag(table, bag_ids, weights, "mean", bag, segment, False)
    return got.astype(jnp.float32).sum() + (pooled.astype(jnp.float32) ** 2).sum()

  return jax.value_and_grad(loss)


def float_args(mesh, dtype, width):
  return (S(mesh, (1000, width), dtype), S(mesh, (512,), jnp.int32),
          S(mesh, (64, 16), jnp.int32), S(mesh, (64, 16), jnp.float32))


LOOKUP_KERNELS = {"embedlib_gather_rows", "embedlib_bag_rows", "embedlib_segment_rows",
                  "embedlib_segment_rows_long"}


@pytest.fixture(scope="module")
def float32_program(mesh):
  def program(table, ids, bag_ids, weights, q8, q4):
    out = lookups(jnp.float32, 128)(table, ids, bag_ids, weights)
    quantized = [quant_rows.bag_rows(q, bag_ids, weights, combiner="sqrtn",
                                     variant=rows.default_variant("bag", 68, 64)) for q in (q8, q4)]
    quantized += [quant_rows.gather_rows(q, ids) for q in (q8, q4)]
    return out, quantized

  quantized = [fmt.QuantizedTable(S(mesh, (1000, fmt.block_bytes(bits, 128)), jnp.uint8),
                                  S(mesh, (1000, 1, 2), jnp.float16), bits, 128) for bits in (8, 4)]
  return ptx.compiled_kernels(program, *float_args(mesh, jnp.float32, 128), *quantized, mesh=mesh,
                              compiler_options=compiled.CHECK_OPTIONS)


@pytest.fixture(scope="module")
def bfloat16_program(mesh):
  return ptx.compiled_kernels(lookups(jnp.bfloat16, 64), *float_args(mesh, jnp.bfloat16, 64),
                              mesh=mesh, compiler_options=compiled.CHECK_OPTIONS)


def assert_no_spills(kernels):
  for k in kernels.values():
    assert k.spill_stores == k.spill_loads == 0 and 0 < k.registers <= 255, k


def test_float32_lookups_backward_and_quantized_rows_compile(float32_program):
  assert LOOKUP_KERNELS | {"embedlib_quantized_bag_rows",
                           "embedlib_quantized_gather_rows"} <= set(float32_program)
  assert_no_spills(float32_program)
  # A 512-byte row: every thread's table loads are 16 bytes wide.
  for name in ("embedlib_gather_rows", "embedlib_bag_rows", "embedlib_segment_rows"):
    assert float32_program[name].load_bytes == 16, float32_program[name]
  assert float32_program["embedlib_quantized_bag_rows"].load_bytes == 16   # int8 codes


def test_bfloat16_lookups_and_backward_compile_with_16_byte_loads(bfloat16_program):
  assert LOOKUP_KERNELS <= set(bfloat16_program)
  assert_no_spills(bfloat16_program)
  for name in ("embedlib_gather_rows", "embedlib_bag_rows", "embedlib_segment_rows"):
    assert bfloat16_program[name].load_bytes == 16, bfloat16_program[name]


def test_fused_update_of_every_rule_and_a_gather_of_a_table_past_2_31_elements(mesh):
  n = 96
  vec = lambda dtype=jnp.int32: S(mesh, (n,), dtype)
  table = S(mesh, (ROWS, FEATURES), jnp.float32)
  rules = {"sgd": 0, "adagrad": 1, "adam": 2}
  args = {rule: (table, [table] * len(update_rows.TABLE_SLOTS[rule]), [vec(jnp.float32)] * k)
          for rule, k in rules.items()}

  def program(args, grads, src, starts, ends, rows_, ids):
    updated = {rule: update_rows.fused_update(
        t, grads, src, starts, ends, rows_, jnp.float32(0.1), rule=rule,
        table_slots=tuple(slots), per_run=tuple(per_run), eps=1e-8, b1=0.9, b2=0.999,
        features=FEATURES) for rule, (t, slots, per_run) in args.items()}
    return updated, gather_rows(args["sgd"][0], ids)

  kernels = ptx.compiled_kernels(program, args, S(mesh, (n, FEATURES), jnp.float32), vec(), vec(),
                                 vec(), vec(), vec(), mesh=mesh, donate_argnums=0,
                                 compiler_options=compiled.CHECK_OPTIONS)
  assert {"embedlib_segment_rows", "embedlib_segment_rows_long",
          "embedlib_gather_rows"} <= set(kernels)
  assert_no_spills(kernels)
