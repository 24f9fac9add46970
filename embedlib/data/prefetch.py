"""Host-side prefetch in a background thread, and placing batches on the mesh.

``Prefetcher`` keeps the next K batches ready so the device never waits on
Python producing them; its ``transform`` (e.g. ``to_global_batch``) also runs
in the thread, so the host-to-device copy overlaps the step too.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from embedlib.axes import DATA_AXIS_NAMES, named_data_axes

_ITEM, _END, _ERROR = "item", "end", "error"
_POLL_S = 0.05  # how often a blocked producer checks for close()
_live: weakref.WeakSet = weakref.WeakSet()


class Prefetcher(Iterator):
  """Iterates ``iterable`` ``buffer_size`` items ahead in a daemon thread.

  >>> with Prefetcher(iter(range(5)), buffer_size=2, transform=lambda x: 10 * x) as it:
  ...   list(it)
  [0, 10, 20, 30, 40]

  An exception raised by the producer (or ``transform``) is re-raised by the
  consumer's ``next``, with the producer's traceback attached. ``close()`` (or
  leaving the ``with`` block, or garbage collection, or interpreter exit)
  stops the thread.

  If the source has ``get_state()`` (``SyntheticSource``, ``CriteoReader``),
  ``Prefetcher.get_state()`` returns the source's state right after the last
  batch *consumed*, not the ones buffered ahead, so a checkpoint resumes at
  the right batch.

  Args:
    iterable: any iterable of batches.
    buffer_size: how many items to keep ready (>= 1).
    transform: optional function applied to each item in the thread.
  """

  def __init__(
      self,
      iterable: Iterable,
      buffer_size: int = 2,
      *,
      transform: Callable | None = None,
  ):
    if buffer_size < 1:
      raise ValueError(f"buffer_size must be >= 1, got {buffer_size}.")
    source = iter(iterable)
    get_state = getattr(iterable, "get_state", None)
    self._state = get_state() if get_state is not None else None
    self._has_state = get_state is not None
    self._queue = queue.Queue(maxsize=buffer_size)
    self._stop = threading.Event()
    self._done = False
    # The thread gets no reference to self, so an abandoned Prefetcher can be
    # garbage collected, and its __del__ stops the thread.
    self._thread = threading.Thread(
        target=_produce,
        args=(source, get_state, transform, self._queue, self._stop),
        name="embedlib-prefetch",
        daemon=True,
    )
    self._thread.start()
    _live.add(self)

  def __iter__(self):
    return self

  def __next__(self):
    if self._done:
      raise StopIteration
    kind, value, state = self._queue.get()
    if kind == _ITEM:
      self._state = state
      return value
    self._done = True
    self._thread.join()
    if kind == _ERROR:
      raise value  # the producer's exception object, its traceback included
    raise StopIteration

  def get_state(self) -> dict:
    """The source's state after the last consumed batch."""
    if not self._has_state:
      raise TypeError("the prefetched iterable has no get_state(); nothing to checkpoint.")
    return self._state

  def close(self, timeout: float = 5.0) -> None:
    """Stops the producer thread; waits up to ``timeout`` seconds for it.

    A producer stuck inside the source's own ``next`` cannot be interrupted;
    it is a daemon thread, so it never blocks interpreter exit.
    """
    self._done = True
    self._stop.set()
    while True:  # unblock a producer waiting on a full queue
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
    if self._thread.is_alive() and self._thread is not threading.current_thread():
      self._thread.join(timeout)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    stop = getattr(self, "_stop", None)
    if stop is not None:
      stop.set()


def _produce(source, get_state, transform, out: queue.Queue, stop: threading.Event):
  def put(message) -> bool:
    while not stop.is_set():
      try:
        out.put(message, timeout=_POLL_S)
        return True
      except queue.Full:
        pass
    return False

  try:
    for item in source:
      state = get_state() if get_state is not None else None
      if transform is not None:
        item = transform(item)
      if not put((_ITEM, item, state)):
        return
    put((_END, None, None))
  except BaseException as e:  # pylint: disable=broad-except  # re-raised by the consumer
    put((_ERROR, e, None))


@atexit.register
def _close_all():
  # atexit runs before daemon threads are frozen: stop producers first, so
  # none is mid-way through a device copy while the runtime shuts down.
  for prefetcher in list(_live):
    prefetcher.close(timeout=1.0)


def _check_narrowing(name: str, leaf: np.ndarray, x64: bool) -> None:
  """Refuses 64-bit integers that jax would narrow onto other values (x64 off).

  With ``jax_enable_x64`` off jax stores int64 as int32 and uint64 as uint32,
  wrapping what doesn't fit: an id of ``2**32 + 5`` would look up row 5.

  >>> _check_narrowing("['ids']", np.array([2**32 + 5]), x64=False)
  Traceback (most recent call last):
  ...
  ValueError: batch['ids'] holds int64 values up to 4294967301 with jax_enable_x64 off: ...
  """
  if x64 or leaf.dtype.kind not in "iu" or leaf.dtype.itemsize != 8 or not leaf.size:
    return
  narrow = np.iinfo(np.int32 if leaf.dtype.kind == "i" else np.uint32)
  low, high = leaf.min(), leaf.max()
  if low >= narrow.min and high <= narrow.max:
    return
  bound = f"up to {high}" if high > narrow.max else f"down to {low}"
  raise ValueError(
      f"batch{name} holds {leaf.dtype} values {bound} with jax_enable_x64 off: jax would "
      f"store them as {narrow.dtype} and wrap them onto other values (an id onto another "
      "table row). Turn x64 on (jax.config.update('jax_enable_x64', True)) or map the "
      f"values into {narrow.dtype}'s range (e.g. hash ids below the table size).")


def to_global_batch(batch, mesh, data_axes: str | Sequence[str] | None = None):
  """Puts a per-process numpy batch onto ``mesh``, split on the leading dimension.

  >>> import jax
  >>> from embedlib import data
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> batch = data.SyntheticSource(data.DataSpec.from_sizes(2, [10]), batch_size=16).batch(0)
  >>> g = to_global_batch(batch, mesh)
  >>> g["dense"].shape, g["sparse"]["f0"].sharding.spec == jax.P("data")
  ((16, 2), True)

  Args:
    batch: pytree of arrays with this process's ``[B_local, ...]`` rows.
    mesh: the device mesh (``jax.sharding.Mesh``).
    data_axes: mesh axes the batch dimension is split over; default the mesh
      axes named like data axes (``embedlib.axes.DATA_AXIS_NAMES``).

  Returns:
    The same pytree of global ``jax.Array`` of ``[B_local * process_count, ...]``
    rows with sharding ``NamedSharding(mesh, P(data_axes))``.
  """
  # jax is imported here so that reading data (and its tests' subprocesses)
  # does not pay for importing it.
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  if data_axes is None:
    data_axes = named_data_axes(mesh.axis_names)
    if not data_axes:
      raise ValueError(
          f"mesh axes {mesh.axis_names} include no data axis (one of {DATA_AXIS_NAMES}); "
          "pass data_axes=('your_axis',)."
      )
  data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
  unknown = [a for a in data_axes if a not in mesh.axis_names]
  if unknown:
    raise ValueError(f"data_axes {unknown} are not axes of the mesh {mesh.axis_names}.")
  sharding = NamedSharding(mesh, PartitionSpec(data_axes))

  def place(path, leaf):
    leaf = np.asarray(leaf)
    _check_narrowing(jax.tree_util.keystr(path), leaf, jax.config.jax_enable_x64)
    try:
      return jax.make_array_from_process_local_data(sharding, leaf)
    except ValueError as e:
      raise ValueError(
          f"batch{jax.tree_util.keystr(path)} with {leaf.shape[0] if leaf.ndim else 0} "
          f"local rows cannot be split over data_axes {data_axes} "
          f"({ {a: mesh.shape[a] for a in data_axes} }); make the per-process batch "
          "a multiple of this process's share of those axes."
      ) from e

  return jax.tree_util.tree_map_with_path(place, batch)
