"""Padded, sharded arrays saved at their logical shape and loaded shard by shard.

A table lives on the mesh padded and split (``ShardedEmbed``); its checkpoint
must hold the logical ``[num_embeddings, features]`` array, without padding,
and load onto any mesh. Stripping the padding with a jax op would need a
logical array sharded over the mesh, which jax can't express when the
logical size doesn't divide the shard count, so it would be gathered whole
onto every device. Instead, each device writes the part of its shard that
lies inside the logical shape into a zarr array of the logical shape (one
chunk per shard, so no two writers share a chunk), and on restore each device
reads the part of the logical array its new shard covers, zeros beyond it.
No XLA program runs and no buffer larger than a shard exists, on the device
or on the host.

``ShardedArraysHandler`` is an orbax ``AsyncCheckpointHandler``: ``save``
takes host views of the shards (no copy on CPU), and the writes read them,
so arrays that are donated while a write runs get copied by XLA instead
(see ``Checkpointer``'s ``asynchronous``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import math
import typing as tp
import urllib.parse

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

_INDEX = "arrays.json"


@dataclasses.dataclass(frozen=True)
class Logical:
  """A padded array (a ``jax.Array`` to save, or a ``ShapeDtypeStruct`` with a
  sharding to restore into) and the logical shape stored for it.

  ``segments``: ``(logical row, rows, physical row)`` runs saying where the
  logical rows lie in ``array`` (a member of a stack of tables, whose rows
  the placement scatters over the devices); None: logical row ``r`` is row
  ``r``, followed by padding.
  """

  array: jax.Array | jax.ShapeDtypeStruct
  logical_shape: tuple[int, ...]
  segments: tuple[tuple[int, int, int], ...] | None = None

  def runs(self) -> tuple[tuple[int, int, int], ...]:
    return self.segments if self.segments is not None else ((0, self.logical_shape[0], 0),)


@dataclasses.dataclass(frozen=True)
class Stacked:
  """One padded array holding several stored arrays at rows of their own.

  A stack of tables (or a row slot of one) is restored from its members,
  each saved under its own name as a ``Logical`` with ``segments`` into
  the same ``array``; to save, pass the members themselves.
  """

  array: jax.ShapeDtypeStruct
  members: dict[str, Logical]


def stored(items: dict) -> dict[str, Logical]:
  """``{name: Logical}`` of every array stored for ``items`` (stacks by member)."""
  out = {}
  for name, item in items.items():
    out.update(item.members if isinstance(item, Stacked) else {name: item})
  return out


def _spec(directory, name: str) -> dict:
  path = str(directory / urllib.parse.quote(name, safe=""))
  return {"driver": "zarr", "kvstore": {"driver": "file", "path": path}}


def _clip(index: tuple, physical: tuple, logical: tuple) -> tuple[slice, ...]:
  """``index`` (slices of the padded array) cut to the logical shape (maybe empty)."""
  out = []
  for s, p, n in zip(index, physical, logical):
    start, stop = (s.start or 0), (p if s.stop is None else s.stop)
    out.append(slice(min(start, n), min(stop, n)))
  return tuple(out)


def _pieces(index: tuple, physical: tuple, item: Logical):
  """``(stored region, region of the shard)`` pairs: where a shard's rows go.

  ``index`` is the shard's slices of the padded array; a run of logical
  rows may cover part of the shard, and the shard part of a run.
  """
  first = index[0].start or 0
  last = physical[0] if index[0].stop is None else index[0].stop
  rest = _clip(index[1:], physical[1:], item.logical_shape[1:])
  if any(r.stop <= r.start for r in rest):
    return
  local_rest = tuple(slice(0, r.stop - r.start) for r in rest)
  for l, n, p in item.runs():
    lo, hi = max(first, p), min(last, p + n)
    if lo < hi:
      yield ((slice(l + lo - p, l + hi - p),) + rest,
             (slice(lo - first, hi - first),) + local_rest)


def _row_chunk(item: Logical, shard_rows: int) -> int:
  """Rows per stored chunk such that every chunk has one writer.

  Writers change at each run's start and at each shard boundary inside a
  run; the chunk is the gcd of those logical rows (all rows if none).
  """
  rows, cut = item.logical_shape[0], 0
  for l, n, p in item.runs():
    points = [l] + [l + b - p for b in range((p // shard_rows + 1) * shard_rows, p + n,
                                               shard_rows)]
    for x in points:
      if 0 < x < rows:
        cut = math.gcd(cut, x)
  return cut or max(rows, 1)


def _read_region(store, region: tuple[slice, ...]) -> np.ndarray:
  """The logical array's ``region``; one shard's worth at most."""
  return store[region].read().result()


class ShardedArraysHandler(ocp.AsyncCheckpointHandler):
  """Saves ``{name: Logical}`` at logical shapes, per shard; restores onto any sharding.

  A restore target may be ``Stacked``: one array read from several stored ones.
  """

  async def _write(self, directory, pieces: dict) -> None:
    for name, (logical, chunks, dtype, shards) in pieces.items():
      spec = _spec(directory, name)
      spec["metadata"] = {"shape": list(logical), "chunks": list(chunks),
                          "dtype": np.dtype(dtype).str, "compressor": {"id": "zstd", "level": 1}}
      # Every chunk is written, zeros included, so a missing chunk file means damage.
      spec["store_data_equal_to_fill_value"] = True
      store = await ts.open(spec, create=True, open=True)
      await asyncio.gather(*(store[region].write(data) for region, data in shards))
    if jax.process_index() == 0:
      index = {name: {"shape": list(p[0]), "dtype": np.dtype(p[2]).str}
               for name, p in pieces.items()}
      (directory / _INDEX).write_text(json.dumps(index))

  async def async_save(self, directory, args: "ShardedArraysSave"):
    pieces = {}
    for name, item in stored(args.arrays).items():
      array, logical = item.array, tuple(item.logical_shape)
      shard_shape = array.sharding.shard_shape(array.shape)
      chunks = (min(_row_chunk(item, shard_shape[0]), logical[0]),) + tuple(
          min(c, n) for c, n in zip(shard_shape[1:], logical[1:]))
      shards = []
      for shard in array.addressable_shards:
        if shard.replica_id != 0:
          continue  # another device writes it
        data = None
        for region, local in _pieces(shard.index, array.shape, item):
          data = np.asarray(shard.data) if data is None else data
          shards.append((region, data[local]))
      pieces[name] = (logical, chunks, array.dtype, shards)
    return [ocp.future.CommitFutureAwaitingContractedSignals(
        self._write(directory, pieces), name="embedlib_sharded_arrays_save")]

  def save(self, directory, args: "ShardedArraysSave"):
    async def run():
      for f in await self.async_save(directory, args):
        f.result()
    # A thread of its own: the caller's thread may already run an event loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      pool.submit(asyncio.run, run()).result()

  def metadata(self, directory) -> dict[str, jax.ShapeDtypeStruct]:
    """``{name: ShapeDtypeStruct(logical shape, dtype)}`` of the saved arrays."""
    index = json.loads((directory / _INDEX).read_text())
    return {name: jax.ShapeDtypeStruct(tuple(v["shape"]), np.dtype(v["dtype"]))
            for name, v in index.items()}

  def restore(self, directory, args: "ShardedArraysRestore") -> dict[str, jax.Array]:
    """Each target's padded array, on its sharding, read shard by shard.

    With ``args.load``, each array goes to ``load(name, array)`` as soon as it
    is read, and the result holds None for it: a caller that replaces its
    arrays one by one holds one array twice at most, not all of them.

    Raises:
      ValueError: an array is missing, has another shape, or lacks a chunk
        (checked for every array before any is read).
    """
    for name, item in args.targets.items():
      self._open(directory, name, item)
    out = {}
    for name, item in args.targets.items():
      array = self._restore_one(directory, name, item)
      if args.load is None:
        out[name] = array
      else:
        args.load(name, array)
        out[name] = None
      del array
    return out

  def _open(self, directory, name: str, item) -> dict:
    """``{stored name: (store, Logical)}`` of a target, checked complete."""
    stores = {}
    for name, part in stored({name: item}).items():
      store = ts.open(_spec(directory, name), open=True).result()
      if tuple(store.shape) != tuple(part.logical_shape):
        raise ValueError(f"{name} is {list(store.shape)} in the checkpoint, "
                         f"{list(part.logical_shape)} in the model.")
      _check_complete(store, name, _spec(directory, name)["kvstore"]["path"])
      stores[name] = (store, part)
    return stores

  def _restore_one(self, directory, name: str, item) -> jax.Array:
    target = item.array
    stores = self._open(directory, name, item)
    shard_shape = target.sharding.shard_shape(target.shape)
    cache = {}

    def read(index):
      key = tuple((s.start, s.stop) for s in index)
      if key not in cache:  # replicas of a shard read it once
        out = np.zeros(shard_shape, target.dtype)
        for store, part in stores.values():
          for region, local in _pieces(index, target.shape, part):
            out[local] = _read_region(store, region)
        cache[key] = out
      return cache[key]

    return jax.make_array_from_callback(target.shape, target.sharding, read)


def _check_complete(store, name: str, path: str) -> None:
  """Raises if a chunk file is missing (zarr would read it as zeros)."""
  chunks = store.chunk_layout.read_chunk.shape
  grid = [range(math.ceil(n / c)) for n, c in zip(store.shape, chunks)]
  expected = {".".join(map(str, k)) for k in itertools.product(*grid)} if grid else {"0"}
  present = {k.decode() for k in store.kvstore.list().result()}
  missing = sorted(expected - present)
  if missing:
    raise ValueError(f"{name}: chunk file(s) {missing[:4]} of the checkpoint are missing "
                     f"from {path}.")


@ocp.args.register_with_handler(ShardedArraysHandler, for_save=True)
@dataclasses.dataclass
class ShardedArraysSave(ocp.args.CheckpointArgs):
  arrays: dict[str, Logical]


@ocp.args.register_with_handler(ShardedArraysHandler, for_restore=True)
@dataclasses.dataclass
class ShardedArraysRestore(ocp.args.CheckpointArgs):
  targets: dict[str, Logical | Stacked]
  load: tp.Callable[[str, jax.Array], None] | None = None
