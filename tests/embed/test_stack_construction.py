"""A stack of tables drawn, loaded and read back without the whole stack on a device.

A stack's rows sit where its placement says; moving them by a gather
(``rowmap.to_physical``) replicates the logical stack on every device. The
compiled memory analysis of the draw and of the moves is the evidence that a
device holds a few blocks instead, and ``rowmap`` (unsharded) is the oracle
for the values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.nnx.nn.linear import default_embed_init
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import _compat
from embedlib import table as table_lib
from embedlib.plan import placement as placement_lib
from embedlib.plan import plan_embedding
from embedlib.strategies import rowmap, stackmove
from tests.embed.contract import make_mesh

EXACT = _compat.JAX_VERSION < (0, 11)
FEATURES = 16
# Table-wise members of uneven sizes, a table-row-wise one and a row-wise one:
# runs cross logical blocks, and every shift of the move carries rows.
MEMBERS = ([placement_lib.Member(f"t{i}", 37 + 11 * i, 8, "table") for i in range(10)]
           + [placement_lib.Member("tr", 150, 8, "table_row"),
              placement_lib.Member("row", 401, 8)])


@pytest.fixture(scope="module")
def stack():
  """(plan, mesh) of a stack over 8 devices."""
  mesh = make_mesh((8,), ("batch",))
  placement = placement_lib.place(MEMBERS, group=8, devices_per_host=4)
  plan = plan_embedding(placement.num_embeddings, FEATURES, mesh=mesh, sharding="routed",
                        placement=placement, name="stack")
  return plan, mesh


def _sizes(plan):
  """(bytes of one device's physical block, bytes of the logical stack)."""
  rows, cols = plan.padded_shape
  return rows * cols * 4 // plan.placement.group, plan.num_embeddings * plan.features * 4


def _physical(plan, mesh):
  return jax.ShapeDtypeStruct(plan.padded_shape, jnp.float32,
                              sharding=NamedSharding(mesh, P(*plan.table_spec)))


def _unsharded(fn, *args):
  with jax.default_device(jax.devices()[0]):
    return np.asarray(fn(*args))


def test_draw_is_the_unsharded_draw_moved_into_place(stack):
  plan, mesh = stack
  key = jax.random.key(3)
  drawn = table_lib.draw(default_embed_init, key, plan, mesh, jnp.float32)
  want = _unsharded(lambda: rowmap.to_physical(
      default_embed_init(key, plan.logical_shape, jnp.float32), plan))
  assert drawn.sharding.spec == P(*plan.table_spec)
  if EXACT:
    np.testing.assert_array_equal(np.asarray(drawn), want)
  else:
    np.testing.assert_allclose(np.asarray(drawn), want, rtol=1e-6, atol=1e-7)


def test_no_device_holds_the_stack_while_drawing(stack):
  plan, mesh = stack
  block, whole = _sizes(plan)
  program = table_lib.program(default_embed_init, plan, mesh, jnp.float32)
  memory = program.lower(jax.random.key(0)).compile().memory_analysis()
  assert memory.output_size_in_bytes == block
  # The draw's random bits (a few logical blocks) and the move's (below); a
  # gather by physical row would hold the logical stack a few times over.
  assert memory.temp_size_in_bytes + memory.output_size_in_bytes < whole


def test_the_move_holds_a_few_blocks(stack):
  plan, mesh = stack
  block, whole = _sizes(plan)
  per_device = stackmove.logical_rows(plan.placement)
  logical = jax.ShapeDtypeStruct((8 * per_device, FEATURES), jnp.float32,
                                 sharding=NamedSharding(mesh, P("batch", None)))
  forward = jax.jit(lambda x: stackmove.to_physical(x, plan, mesh)).lower(logical)
  backward = jax.jit(lambda t: stackmove.to_logical(t, plan, mesh)).lower(_physical(plan, mesh))
  for memory in (forward.compile().memory_analysis(), backward.compile().memory_analysis()):
    # Its logical block, its physical block and one round's buffers.
    assert memory.temp_size_in_bytes <= 3.5 * block < whole


def test_host_table_is_read_block_by_block(stack):
  plan, mesh = stack
  values = np.arange(plan.num_embeddings * FEATURES, dtype=np.float64).reshape(-1, FEATURES)
  host = values.view(_Recording)
  host.reads = []
  loaded = table_lib.load(host, plan, mesh, jnp.float32)
  np.testing.assert_array_equal(
      np.asarray(loaded),
      _unsharded(lambda: rowmap.to_physical(jnp.asarray(values, jnp.float32), plan)))
  per_rank = plan.placement.rows_per_rank
  assert host.reads and all(r[0].stop - r[0].start <= per_rank for r in host.reads)
  assert {s.data.shape for s in loaded.addressable_shards} == {(per_rank, FEATURES)}
  # A device array is moved by the same collectives.
  again = table_lib.load(jnp.asarray(values, jnp.float32), plan, mesh, jnp.float32)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(loaded))


class _Recording(np.ndarray):
  """A host array that records every block read from it (as np.memmap is read)."""

  def __getitem__(self, index):
    self.reads.append(index)
    return np.asarray(super().__getitem__(index))


def test_logical_rows_and_members_come_back_without_the_stack_whole(stack):
  plan, mesh = stack
  block, whole = _sizes(plan)
  values = np.random.default_rng(0).normal(size=plan.logical_shape).astype(np.float32)
  physical = table_lib.load(values, plan, mesh, jnp.float32)
  for replicated in (False, True):
    logical = table_lib.unpad(physical, plan, mesh, replicated=replicated)
    np.testing.assert_array_equal(np.asarray(logical), values)
  assert table_lib.unpad(physical, plan, mesh, replicated=True).sharding.is_fully_replicated
  members = table_lib.stack_members(physical, plan, mesh)
  for name, rows in plan.placement.members:
    start = plan.placement.start(name)
    np.testing.assert_array_equal(np.asarray(members[name]), values[start:start + rows])
    assert members[name].sharding.is_fully_replicated
  unpad = jax.jit(lambda t: table_lib.unpad(t, plan, mesh)).lower(_physical(plan, mesh))
  memory = unpad.compile().memory_analysis()
  assert memory.temp_size_in_bytes + memory.output_size_in_bytes <= 4.5 * block < whole
  rows = table_lib.stack_rows(physical, plan, mesh)
  largest = max(rows for _, rows in plan.placement.members)
  cut = jax.jit(lambda r: stackmove.member(r, plan, mesh, 0, largest)).lower(rows)
  member_bytes = largest * FEATURES * 4
  assert cut.compile().memory_analysis().temp_size_in_bytes <= 2 * member_bytes < whole
