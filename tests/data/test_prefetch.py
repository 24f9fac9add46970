"""Prefetcher threading behaviour and to_global_batch placement."""

import pathlib
import subprocess
import sys
import textwrap
import time
import traceback

import jax
import numpy as np
import pytest

from embedlib.data import DataSpec, Prefetcher, SyntheticSource, to_global_batch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_yields_every_item_in_order_through_transform():
  with Prefetcher(range(100), buffer_size=3, transform=lambda x: x * x) as it:
    assert list(it) == [x * x for x in range(100)]
    with pytest.raises(StopIteration):
      next(it)


def test_state_is_that_of_the_last_consumed_batch_not_the_buffered_ones():
  src = SyntheticSource(DataSpec.from_sizes(1, [10]), batch_size=4)
  with Prefetcher(src, buffer_size=4) as it:
    assert it.get_state() == {"position": 0}
    for consumed in range(1, 4):
      next(it)
      assert it.get_state() == {"position": consumed}
    deadline = time.monotonic() + 10
    while not it._queue.full() and time.monotonic() < deadline:
      time.sleep(0.01)
    assert src.position >= 3 + 4  # the thread ran ahead by the buffer
    assert it.get_state() == {"position": 3}


def failing_source():
  yield 1
  yield 2
  raise KeyError("broken record")


def test_producer_exception_reaches_consumer_with_its_traceback():
  it = Prefetcher(failing_source(), buffer_size=1)
  assert [next(it), next(it)] == [1, 2]
  with pytest.raises(KeyError, match="broken record") as info:
    next(it)
  frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
  assert "failing_source" in frames
  assert not it._thread.is_alive()


def test_close_stops_a_producer_blocked_on_a_full_queue():
  def endless():
    while True:
      yield np.zeros(3)

  it = Prefetcher(endless(), buffer_size=2)
  next(it)
  it.close()
  assert not it._thread.is_alive()
  with pytest.raises(StopIteration):
    next(it)


def test_interpreter_exits_with_unclosed_prefetchers():
  code = textwrap.dedent("""
      import itertools
      from embedlib.data.prefetch import Prefetcher
      blocked = Prefetcher(itertools.count(), buffer_size=2)   # full queue
      busy = Prefetcher(itertools.count(), buffer_size=2)
      next(busy)
      print("done")
      """)
  proc = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == "done"


@pytest.mark.parametrize(
    "shape, names, data_axes, expected_spec",
    [
        ((8,), ("data",), None, ("data",)),
        ((4, 2), ("data", "model"), "data", ("data",)),
        ((2, 4), ("replica", "data"), ("replica", "data"), (("replica", "data"),)),
    ],
)
def test_to_global_batch_shards_rows_over_data_axes(shape, names, data_axes, expected_spec):
  mesh = jax.make_mesh(shape, names)
  batch = SyntheticSource(DataSpec.from_sizes(3, [10, 10], bag_sizes=[1, 2]), batch_size=16).batch(0)
  placed = to_global_batch(batch, mesh, data_axes)
  for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(batch)):
    assert tuple(got.sharding.spec) == expected_spec
    assert got.sharding.mesh == mesh
    np.testing.assert_array_equal(np.asarray(got), want)
  data_size = int(np.prod([mesh.shape[a] for a in np.atleast_1d(expected_spec[0])]))
  assert {s.data.shape[0] for s in placed["label"].addressable_shards} == {16 // data_size}


@pytest.mark.parametrize(
    "names, data_axes, rows, match",
    [
        (("model",), None, 8, "no data axis"),
        (("data",), "nope", 8, "not axes of the mesh"),
        (("data",), None, 6, "6 local rows cannot be split"),
    ],
)
def test_to_global_batch_errors(names, data_axes, rows, match):
  mesh = jax.make_mesh((8,), names)
  with pytest.raises(ValueError, match=match):
    to_global_batch({"label": np.zeros(rows, np.float32)}, mesh, data_axes)


@pytest.mark.parametrize("dtype, value, bound", [
    (np.int64, 2**32 + 5, "up to 4294967301"),   # would look up row 5
    (np.int64, -2**31 - 1, "down to -2147483649"),
    (np.uint64, 2**32, "up to 4294967296"),
])
def test_to_global_batch_refuses_64_bit_values_jax_would_wrap(dtype, value, bound):
  mesh = jax.make_mesh((8,), ("data",))
  ids = np.full((8, 2), 3, dtype)
  ids[5, 1] = value
  with pytest.raises(ValueError, match=rf"batch\['sparse'\]\['f'\] holds .*{bound} with "
                     "jax_enable_x64 off.*jax_enable_x64"):
    to_global_batch({"sparse": {"f": ids}}, mesh)
  ids[5, 1] = 2**31 - 1  # what fits passes, narrowed as jax narrows it
  placed = to_global_batch({"sparse": {"f": ids}}, mesh)["sparse"]["f"]
  np.testing.assert_array_equal(np.asarray(placed), ids)
