"""Arrays stored from runs of rows (a stack's members) and read back onto another layout.

The handler alone, on tiny arrays: no program is compiled.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from embedlib.checkpoint import sharded
from embedlib.checkpoint.sharded import Logical, Stacked

# Two members in a 4-device stack of 3 rows per device: "a" (5 rows) split
# over devices 0 and 1, "b" (2 rows) whole on device 3.
A_RUNS = ((0, 3, 0), (3, 2, 3))
B_RUNS = ((0, 2, 9),)


def put(x, devices):
  mesh = jax.make_mesh((devices,), ("batch",), devices=jax.devices()[:devices])
  return jax.device_put(x, NamedSharding(mesh, P("batch")))


def test_each_stored_chunk_has_one_writer():
  a = Logical(jax.ShapeDtypeStruct((12, 2), np.float32), (5, 2), A_RUNS)
  assert sharded._row_chunk(a, 3) == 3        # device 0 writes rows 0:3, device 1 rows 3:5
  assert sharded._row_chunk(Logical(a.array, (2, 2), B_RUNS), 3) == 2
  plain = Logical(a.array, (10, 2))
  assert sharded._row_chunk(plain, 3) == 3    # one chunk per shard, as before


def test_members_round_trip_onto_another_layout(tmp_path):
  a, b = np.arange(10.0).reshape(5, 2), 100 + np.arange(4.0).reshape(2, 2)
  stack = np.zeros((12, 2), np.float32)
  stack[0:3], stack[3:5], stack[9:11] = a[:3], a[3:], b
  arrays = {"a": Logical(put(stack, 4), (5, 2), A_RUNS),
            "b": Logical(put(stack, 4), (2, 2), B_RUNS)}
  handler = sharded.ShardedArraysHandler()
  handler.save(tmp_path, sharded.ShardedArraysSave(arrays))
  # As tables of their own on 2 devices (padded), and as one stack laid out otherwise.
  own = {n: Logical(jax.ShapeDtypeStruct((6, 2), np.float32, sharding=put(np.zeros((6, 2)), 2)
                                         .sharding), shape)
         for n, shape in (("a", (5, 2)), ("b", (2, 2)))}
  target = jax.ShapeDtypeStruct((8, 2), np.float32, sharding=put(np.zeros((8, 2)), 2).sharding)
  other = Stacked(target, {"a": Logical(target, (5, 2), ((0, 5, 0),)),
                           "b": Logical(target, (2, 2), ((0, 2, 6),))})
  got = handler.restore(tmp_path, sharded.ShardedArraysRestore({**own, "stack": other}))
  np.testing.assert_array_equal(np.asarray(got["a"])[:5], a)
  np.testing.assert_array_equal(np.asarray(got["b"]), np.pad(b, ((0, 4), (0, 0))))
  want = np.zeros((8, 2), np.float32)
  want[:5], want[6:] = a, b
  np.testing.assert_array_equal(np.asarray(got["stack"]), want)
