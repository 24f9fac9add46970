"""One shard's step of a dynamic table's map on CPU as a C++ kernel (``cpu/dynamic_map.cc``).

``dynamic.step.admit_step`` sorts the step's ids by (bucket, id) and scans
each id's bucket: on a GPU that is cheap, but XLA:CPU's sort calls a
comparator per comparison, and the sort and the scan cost more than the
table's whole sparse update. The kernel splits the buckets into one range
per thread; each thread groups its buckets' ids with a counting sort, sorts
each bucket's few ids alone and runs the policy one bucket at a time, with
the same results bit for bit. ``mark_placed_cpu`` stamps the placed rows'
clocks in one pass (XLA copies the clocks around the gather of the old ones
and the scatter of the new), and ``set_rows_cpu`` writes the placed rows'
initial values (XLA:CPU's scatter of whole rows goes element by element);
``place_hashed_uniform_cpu`` draws them there too, for the default
initializer, whose values the kernel computes itself. For that initializer
``map_step_place_cpu`` does the step, the marks and the draws in one pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from embedlib.kernels import cpu_library

#: The kernel's codes for the eviction policies (``dynamic.policy``'s names).
EVICTION_CODES = {None: 0, "lru": 1, "lfu": 2}


def map_step_cpu(keys_hi, keys_lo, score, sketch, hi, lo, own, bucket, cells, clock, *,
                 bucket_size: int, eviction: str | None, admit_after: int, decay_every: int):
  """The map's step of ``dynamic.step.admit_step``, through the C++ kernel.

  Args:
    keys_hi, keys_lo: uint32 ``[rows]``; score: int32 ``[rows]`` (``-1``: free).
    sketch: uint8 ``[buckets, depth, width]``, or None (no admission sketch).
    hi, lo: uint32 ``[m]`` id words; own: bool ``[m]``; bucket: int32 ``[m]``
      local buckets (read where ``own``).
    cells: int32 ``[m, depth]``, each id's sketch cell per sketch row (None
      with no sketch).
    clock: int32 scalar, the clock before this step.
    bucket_size, eviction, admit_after, decay_every: the table's policy.

  Returns:
    ``(keys_hi, keys_lo, score, sketch, rows, placed, stats)`` as
    ``admit_step`` defines them (``sketch`` None when given None).

  Raises:
    RuntimeError: without the CPU kernels' library (``cpu_library.call``).
  """
  operands, results, attrs, unflat = _step_call(keys_hi, keys_lo, score, sketch, hi, lo, own,
                                                bucket, cells, clock, bucket_size, eviction,
                                                admit_after, decay_every)
  return unflat(cpu_library.call("embedlib_dynamic_map_step", results, *operands,
                                 aliases={0: 0, 1: 1, 2: 2, 3: 3}, **attrs))


def _step_results(keys_hi, keys_lo, score, sketch, m, stats, bucket_size, eviction,
                  admit_after, decay_every):
  """A map step's flat sketch operand, its results for ``m`` ids with
  ``stats`` statistics (the map, rows, placed, stats) and its attributes."""
  has_sketch = sketch is not None
  depth, width = (sketch.shape[1], sketch.shape[2]) if has_sketch else (0, 1)
  sk = sketch.reshape(-1) if has_sketch else jnp.zeros((1,), jnp.uint8)
  results = [
      jax.ShapeDtypeStruct(keys_hi.shape, jnp.uint32),
      jax.ShapeDtypeStruct(keys_lo.shape, jnp.uint32),
      jax.ShapeDtypeStruct(score.shape, jnp.int32),
      jax.ShapeDtypeStruct(sk.shape, jnp.uint8),
      jax.ShapeDtypeStruct((m,), jnp.int32),
      jax.ShapeDtypeStruct((m,), jnp.bool_),
      jax.ShapeDtypeStruct((stats,), jnp.int32),
  ]
  attrs = dict(bucket_size=np.int64(bucket_size), eviction=np.int64(EVICTION_CODES[eviction]),
               admit_after=np.int64(admit_after), decay_every=np.int64(decay_every),
               depth=np.int64(depth), width=np.int64(width))
  return sk, results, attrs


def _step_call(keys_hi, keys_lo, score, sketch, hi, lo, own, bucket, cells, clock, bucket_size,
               eviction, admit_after, decay_every):
  """The map step's operands, results and attributes for the kernel, and
  the function that turns its results into ``map_step_cpu``'s."""
  has_sketch = sketch is not None
  sk, results, attrs = _step_results(keys_hi, keys_lo, score, sketch, hi.shape[0], 4,
                                     bucket_size, eviction, admit_after, decay_every)
  cl = cells.reshape(-1).astype(jnp.int32) if has_sketch else jnp.zeros((1,), jnp.int32)
  operands = (keys_hi, keys_lo, score, sk, hi, lo, own.astype(jnp.bool_),
               bucket.astype(jnp.int32), cl, clock.astype(jnp.int32))

  def unflat(outs):
    khi, klo, sc, sk, rows, placed, stats = outs
    return khi, klo, sc, (sk.reshape(sketch.shape) if has_sketch else None), rows, placed, stats

  return operands, results, attrs, unflat


def map_step_place_cpu(keys_hi, keys_lo, score, sketch, words, clock, placed_at, table,
                       key_words, index, *, bucket_size: int, eviction: str | None,
                       admit_after: int, decay_every: int, num_buckets: int, never: int,
                       step: float):
  """``map_step_cpu`` on the ids' words that also places the rows, as
  ``mark_placed_cpu`` then ``place_hashed_uniform_cpu`` would: one pass where
  there were three, and none before it.

  Each id's bucket, whether it is this shard's (not padding, its bucket
  among this shard's) and its sketch cells are computed in the kernel, as
  ``dynamic.mapping._own`` and ``ids.sketch_cell`` compute them. Each placed
  row's mark in ``placed_at`` becomes the step's clock (``clock + 1``), and a
  row placed over a mark other than ``never`` is drawn into ``table``
  (``initializers.HashedUniform``'s values of its global row), while the
  map's step has its bucket in the caches.

  Args:
    keys_hi, keys_lo, score, sketch, clock: as ``map_step_cpu``'s, for this
      shard's ``R`` rows.
    words: uint32 ``[m, 2]``, the step's id words (``ids.Words``).
    placed_at: int32 ``[R]``, each row's mark; updated in place when donated.
    table: float32 ``[R, features]``; updated in place when donated.
    key_words, step: as ``place_hashed_uniform_cpu``'s.
    index: int32 scalar, this shard's index: it owns buckets ``[index * B,
      (index + 1) * B)`` of ``num_buckets``, ``B = R / bucket_size``, and its
      rows are global rows ``index * R`` on.
    bucket_size ... decay_every: as ``map_step_cpu``'s.
    num_buckets: the whole table's buckets.
    never: the mark of a row never placed.

  Returns:
    ``(keys_hi, keys_lo, score, sketch, rows, placed, stats, placed_at,
    table)``: rows are global (``-1``: not resident, or not this shard's),
    stats int32 ``[5]``, ``map_step_cpu``'s four and then the ids this shard
    owns.

  Raises:
    RuntimeError: without the CPU kernels' library (``cpu_library.call``).
  """
  sk, results, attrs = _step_results(keys_hi, keys_lo, score, sketch, words.shape[0], 5,
                                     bucket_size, eviction, admit_after, decay_every)
  results += [jax.ShapeDtypeStruct(placed_at.shape, jnp.int32),
              jax.ShapeDtypeStruct(table.shape, jnp.float32)]
  khi, klo, sc, sk, rows, placed, stats, placed_at, table = cpu_library.call(
      "embedlib_dynamic_map_step_place", results, keys_hi, keys_lo, score, sk,
      jnp.asarray(words, jnp.uint32), clock.astype(jnp.int32), placed_at.astype(jnp.int32),
      table, jnp.asarray(key_words, jnp.uint32).reshape(2), jnp.asarray(index, jnp.int32),
      aliases={0: 0, 1: 1, 2: 2, 3: 3, 6: 7, 7: 8},
      vary_like=[None] * 7 + [placed_at, table], num_buckets=np.int64(num_buckets),
      never=np.int64(never), step=np.float32(step), **attrs)
  return (khi, klo, sc, (None if sketch is None else sk.reshape(sketch.shape)), rows, placed,
          stats, placed_at, table)


def lookup_cpu(keys_hi, keys_lo, score, hi, lo, own, bucket, *, bucket_size: int):
  """The rows of ``dynamic.step.lookup`` (int32 ``[m]``, ``-1``: not resident
  here), through the C++ kernel; the arguments as ``map_step_cpu``'s."""
  (rows,) = cpu_library.call(
      "embedlib_dynamic_map_lookup", [jax.ShapeDtypeStruct(hi.shape, jnp.int32)],
      keys_hi, keys_lo, score, hi, lo, own.astype(jnp.bool_), bucket.astype(jnp.int32),
      bucket_size=np.int64(bucket_size))
  return rows


def mark_placed_cpu(placed_at, rows, placed, stamp, *, never: int):
  """The placed rows' new marks and the rows placed again, through the C++ kernel.

  The same as::

    again = placed_at[jnp.clip(rows, 0, n - 1)] != never
    drawn = jnp.where(placed & again, rows, n)
    placed_at = placed_at.at[jnp.where(placed, rows, n)].set(stamp, mode="drop")

  Args:
    placed_at: int32 ``[n]``, each row's mark; updated in place when donated.
    rows: int32 ``[m]`` local rows, distinct where ``placed`` and in ``[0, n)``.
    placed: bool ``[m]``.
    stamp: int32 scalar, the placed rows' new mark.
    never: the mark of a row never placed.

  Returns:
    ``(placed_at, drawn)``: drawn int32 ``[m]``, ``rows`` where placed over a
    mark other than ``never``, else ``n``.

  Raises:
    RuntimeError: without the CPU kernels' library (``cpu_library.call``).
  """
  return tuple(cpu_library.call(
      "embedlib_mark_placed", [jax.ShapeDtypeStruct(placed_at.shape, jnp.int32),
                               jax.ShapeDtypeStruct(rows.shape, jnp.int32)],
      placed_at.astype(jnp.int32), rows.astype(jnp.int32), placed.astype(jnp.bool_),
      jnp.asarray(stamp, jnp.int32), aliases={0: 0}, never=np.int64(never)))


def set_rows_cpu(table, rows, values):
  """``table.at[rows].set(values, mode="drop")`` for distinct ``rows``, through the C++ kernel.

  Args:
    table: ``[n, features]``, any dtype; updated in place when donated.
    rows: int32 ``[k]``, distinct where in ``[0, n)``; others are skipped.
    values: ``[k, features]`` of the table's dtype.

  Raises:
    RuntimeError: without the CPU kernels' library (``cpu_library.call``).
  """
  (out,) = cpu_library.call(
      "embedlib_set_rows", [jax.ShapeDtypeStruct(table.shape, table.dtype)], table,
      rows.astype(jnp.int32), values.astype(table.dtype), aliases={0: 0}, vary_like=[table])
  return out


def place_hashed_uniform_cpu(table, rows, key_words, offset, *, step: float):
  """``initializers.HashedUniform``'s values of the ``rows`` set in ``table``, by the C++ kernel.

  The same bits as ``table.at[rows].set(HashedUniform(scale).rows(key_data, rows + offset,
  features), mode="drop")``, drawn straight into the rows, with no ``[k, features]`` block.

  Args:
    table: float32 ``[n, features]``; updated in place when donated.
    rows: int32 ``[k]`` local rows, distinct where in ``[0, n)``; others are skipped.
    key_words: uint32 ``[2]``, ``initializers.key_words(key_data)``.
    offset: int32 scalar, the first local row's global number.
    step: ``HashedUniform.step(features)``, as a float32.

  Raises:
    RuntimeError: without the CPU kernels' library (``cpu_library.call``).
  """
  (out,) = cpu_library.call(
      "embedlib_place_hashed_uniform", [jax.ShapeDtypeStruct(table.shape, table.dtype)], table,
      rows.astype(jnp.int32), jnp.asarray(key_words, jnp.uint32).reshape(2),
      jnp.asarray(offset, jnp.int32), aliases={0: 0}, vary_like=[table], step=np.float32(step))
  return out
