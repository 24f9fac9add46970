"""Each Pallas kernel compiles for an H100 (XLA, Mosaic GPU, ptxas for sm_90a), without one.

One program per dtype holds the gather, the weighted mean bag and their
backward (``embedlib_segment_sum``); the Triton kernels get one program;
the tables past 2**31 elements (100M x 64 float32, from
``tests/kernels/test_large_tables.py``) get one program for the lookups and
one for the fused update of every rule. Lowering tests
(``tests/kernels/test_lowering.py``) read each kernel's own module; these
prove that the kernels and the programs around them compile.

CI compiles the bfloat16 program of 256-wide rows and every other program
here (each float32, at a row width of its own); ``-m slow`` adds the float32
one of 256-wide rows.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from embedlib import kernels
from embedlib.kernels import deviceless, mosaic_update
from tests.gpu_compile import compiled
from tests.kernels.test_large_tables import FEATURES, ROWS

S = jax.ShapeDtypeStruct
LOOKUP_KERNELS = ("embedlib_gather_mosaic", "embedlib_bag_mosaic", "embedlib_segment_sum_mosaic")


@pytest.fixture(scope="module")
def mesh():
  return deviceless.gpu_mesh((1,), ("x",), target="H100")


def lookups_and_grads(kernel):
  """Gather and weighted mean bag of one table, and the table's gradient through both."""
  def loss(table, ids, bag_ids, weights):
    rows = kernels.gather(table, ids, kernel=kernel)
    bags = kernels.bag(table, bag_ids, weights, combiner="mean", kernel=kernel)
    return rows.astype(jnp.float32).sum() + (bags.astype(jnp.float32) ** 2).sum()

  return jax.value_and_grad(loss)


def lookup_args(mesh, rows, features, dtype):
  rep = NamedSharding(mesh, P())
  return (S((rows, features), dtype, sharding=rep), S((512,), jnp.int32, sharding=rep),
          S((64, 8), jnp.int32, sharding=rep), S((64, 8), jnp.float32, sharding=rep))


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, id="f32", marks=pytest.mark.slow),
                                   pytest.param(jnp.bfloat16, id="bf16")])
def test_mosaic_lookups_and_backward_compile(mesh, dtype):
  program = compiled.compile_checked(
      f"mosaic {jnp.dtype(dtype).name}", lookups_and_grads("mosaic"),
      *lookup_args(mesh, 1000, 256, dtype), mesh=mesh)
  compiled.check_all(program, kernels=LOOKUP_KERNELS)


def test_mosaic_gather_of_rows_off_128_bytes_compiles(mesh):
  """Rows of 100 float32 (400 bytes): padded in shared memory, written out row by row.

  The rows an H200 faulted on ("misaligned address") before the padding.
  """
  program = compiled.compile_checked(
      "mosaic gather 100 wide", lookups_and_grads("mosaic"),
      *lookup_args(mesh, 1000, 100, jnp.float32), mesh=mesh)
  compiled.check_all(program, kernels=LOOKUP_KERNELS)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_triton_lookups_and_backward_compile(mesh):
  program = compiled.compile_checked(
      "triton", lookups_and_grads("triton"), *lookup_args(mesh, 1000, 192, jnp.float32),
      mesh=mesh)
  compiled.check_all(program)
  assert "__gpu$xla.gpu.triton" in compiled.custom_calls(program.text)
  assert not program.mosaic_kernels


def test_lookups_of_a_table_past_2_31_elements_compile(mesh):
  program = compiled.compile_checked(
      "large lookups", lookups_and_grads("mosaic"),
      *lookup_args(mesh, ROWS, FEATURES, jnp.float32), mesh=mesh)
  compiled.check_all(program, kernels=LOOKUP_KERNELS)
  # The table, its gradient, and one table-sized temporary: the gather's and
  # the bag's gradients are two dense terms summed. Nothing else of that size.
  table = ROWS * FEATURES * 4
  assert 3 * table <= compiled.total_bytes(program.memory) < 3 * table + table // 100


RULES = {"sgd": 0, "adagrad": 1, "adam": 2}   # rule -> per-run vectors (mosaic_update)


def test_fused_update_of_every_rule_compiles_for_a_table_past_2_31_elements(mesh):
  """SGD, row-wise AdaGrad and LazyAdam's fused update kernels, one program, in place."""
  rep = NamedSharding(mesh, P())
  n = 96
  vec = lambda dtype=jnp.int32: S((n,), dtype, sharding=rep)
  table = S((ROWS, FEATURES), jnp.float32, sharding=rep)
  for rule in RULES:
    if not mosaic_update.supports((ROWS, FEATURES), jnp.float32, rule=rule):
      pytest.fail(f"jax {jax.__version__} with the CUDA plugin should take the fused {rule} update")
  args = {rule: (table, [table] * len(mosaic_update.TABLE_SLOTS[rule]),
                 [vec(jnp.float32)] * per_run) for rule, per_run in RULES.items()}

  def updates(args, grads, src, starts, ends, rows):
    return {rule: mosaic_update.fused_update(
        t, grads, src, starts, ends, rows, jnp.float32(0.1), rule=rule,
        table_slots=tuple(slots), per_run=tuple(per_run), eps=1e-8, b1=0.9, b2=0.999,
        features=FEATURES) for rule, (t, slots, per_run) in args.items()}

  program = compiled.compile_checked(
      "fused updates", updates, args, S((n, FEATURES), jnp.float32, sharding=rep), vec(), vec(),
      vec(), vec(), mesh=mesh, donate_argnums=0)
  compiled.check_all(program)
  assert len([k for k in program.ptxas if k.startswith("embedlib_fused_update_mosaic")]) == 3
  # Updated in place: every table and moment is an output aliased to its input.
  tables = sum(1 + len(mosaic_update.TABLE_SLOTS[rule]) for rule in RULES) * ROWS * FEATURES * 4
  assert tables <= program.memory.alias_size_in_bytes < tables + tables // 1000


def test_lookups_and_backward_of_rows_2048_floats_wide_compile(mesh):
  """32 rows of 2048 floats (256 KiB) exceed a block's 227 KiB: the kernels split the columns."""
  program = compiled.compile_checked(
      "wide rows", lookups_and_grads("mosaic"), *lookup_args(mesh, 1000, 2048, jnp.float32),
      mesh=mesh)
  compiled.check_all(program, kernels=LOOKUP_KERNELS)
