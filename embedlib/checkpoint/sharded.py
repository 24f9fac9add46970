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

``ShardedArraysHandler`` is an orbax ``AsyncCheckpointHandler``: the copies
to the host happen in ``save`` (the arrays may be donated right after), the
writes in the background.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import math
import urllib.parse

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

_INDEX = "arrays.json"


@dataclasses.dataclass(frozen=True)
class Logical:
  """A padded array (a ``jax.Array`` to save, or a ``ShapeDtypeStruct`` with a
  sharding to restore into) and the logical shape stored for it."""

  array: jax.Array | jax.ShapeDtypeStruct
  logical_shape: tuple[int, ...]


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


def _read_region(store, region: tuple[slice, ...]) -> np.ndarray:
  """The logical array's ``region``; one shard's worth at most."""
  return store[region].read().result()


class ShardedArraysHandler(ocp.AsyncCheckpointHandler):
  """Saves ``{name: Logical}`` at logical shapes, per shard; restores onto any sharding."""

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
    for name, item in args.arrays.items():
      array, logical = item.array, tuple(item.logical_shape)
      shard_shape = array.sharding.shard_shape(array.shape)
      chunks = tuple(min(c, n) for c, n in zip(shard_shape, logical))
      shards = []
      for shard in array.addressable_shards:
        region = _clip(shard.index, array.shape, logical)
        if shard.replica_id != 0 or any(r.stop <= r.start for r in region):
          continue  # another device writes it, or it is all padding
        local = tuple(slice(0, r.stop - r.start) for r in region)
        shards.append((region, np.asarray(shard.data)[local]))
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

    Raises:
      ValueError: an array is missing, has another shape, or lacks a chunk.
    """
    return {name: self._restore_one(directory, name, item) for name, item in args.targets.items()}

  def _restore_one(self, directory, name: str, item: Logical) -> jax.Array:
    target, logical = item.array, tuple(item.logical_shape)
    store = ts.open(_spec(directory, name), open=True).result()
    if tuple(store.shape) != logical:
      raise ValueError(f"{name} is {list(store.shape)} in the checkpoint, {list(logical)} "
                       "in the model.")
    _check_complete(store, name)
    shard_shape = target.sharding.shard_shape(target.shape)
    cache = {}

    def read(index):
      region = _clip(index, target.shape, logical)
      key = tuple((r.start, r.stop) for r in region)
      if key not in cache:  # replicas of a shard read it once
        out = np.zeros(shard_shape, target.dtype)
        if all(r.stop > r.start for r in region):
          data = _read_region(store, region)
          out[tuple(slice(0, r.stop - r.start) for r in region)] = data
        cache[key] = out
      return cache[key]

    return jax.make_array_from_callback(target.shape, target.sharding, read)


def _check_complete(store, name: str) -> None:
  """Raises if a chunk file is missing (zarr would read it as zeros)."""
  chunks = store.chunk_layout.read_chunk.shape
  grid = [range(math.ceil(n / c)) for n, c in zip(store.shape, chunks)]
  expected = {".".join(map(str, k)) for k in itertools.product(*grid)} if grid else {"0"}
  present = {k.decode() for k in store.kvstore.list().result()}
  missing = sorted(expected - present)
  if missing:
    raise ValueError(f"{name}: chunk file(s) {missing[:4]} of the checkpoint are missing.")


@ocp.args.register_with_handler(ShardedArraysHandler, for_save=True)
@dataclasses.dataclass
class ShardedArraysSave(ocp.args.CheckpointArgs):
  arrays: dict[str, Logical]


@ocp.args.register_with_handler(ShardedArraysHandler, for_restore=True)
@dataclasses.dataclass
class ShardedArraysRestore(ocp.args.CheckpointArgs):
  targets: dict[str, Logical]
