"""The memory-bandwidth limit of a sparse step: the bytes it must touch, and a copy of them.

A sparse row-wise AdaGrad step does little arithmetic per byte, so its
floor is the time to move the bytes it cannot avoid moving. ``step_bytes``
counts them; ``copy_step`` builds a pass over a buffer that reads and
writes as many bytes in total, to time in the same run as the step, so the
ratio step / copy says how far the step is from this machine's bandwidth.
"""

import json
import os
import statistics
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

MiB = 1 << 20
F32 = 4
#: A buffer far past any cache, so that its copy moves DRAM.
DRAM_COPY_BYTES = 1 << 30


def step_bytes(ids, width):
  """The bytes one sparse step of a float32 ``[vocab, width]`` table must touch, by part.

  - the ids, read once (int32);
  - the lookup: the looked-up rows read from the table, ``ids x width``,
    repeats counted (the gather reads a row once per occurrence), and the
    ``[ids, width]`` rows it writes;
  - the update: each distinct touched row of the table read and written,
    ``2 x unique x width``, and its AdaGrad slot (one float32 per row)
    read and written, ``2 x unique``.

  Not counted: the gradient of the looked-up rows, ``[ids, width]``, which
  the backward writes once and the update reads once (``row_gradient_bytes``).
  The rows are the lookup's output, which the model after it consumes, so a
  step must write them; their gradient is the model's to produce, and an
  update fused into the backward (FBGEMM's) takes each row's gradient as it
  is made, without a round trip through memory. So this is the floor.

  Args:
    ids: ``[n]`` int, the step's ids (all valid).
    width: the table's columns.

  Returns:
    part -> bytes, in the order above.
  """
  n = int(np.size(ids))
  unique = len(np.unique(np.asarray(ids)))
  return {
      "ids read": n * 4,
      "looked-up rows read (gather, repeats counted)": n * width * F32,
      "looked-up rows written [ids, width]": n * width * F32,
      f"distinct rows read + written (2 x {unique:,} x {width})": 2 * unique * width * F32,
      f"AdaGrad slots read + written (2 x {unique:,})": 2 * unique * F32,
  }


def row_gradient_bytes(ids, width):
  """The row gradient ``[ids, width]`` written once and read once (not in ``step_bytes``)."""
  return 2 * int(np.size(ids)) * width * F32


def model_bytes(ids, width):
  """What a model kept apart from its lookup adds to ``step_bytes``: it reads the
  ``[ids, width]`` rows the lookup wrote and writes their gradient, which the
  update reads back (``row_gradient_bytes``).

  Every step of a drop-in for ``nnx.Embed`` has them, FBGEMM's too: its fused
  backward is handed the gradient of the rows, made by the layers above.
  """
  return int(np.size(ids)) * width * F32 + row_gradient_bytes(ids, width)


def copy_step(total_bytes):
  """A ``step(buffer, ids) -> (None, buffer)`` that reads and writes ``total_bytes`` in all.

  An in-place ``x + 1`` over a donated float32 buffer of ``total_bytes / 2``
  (read once, written once, as the step's state is). In place because a
  fresh output buffer would be fresh pages on CPU, each first touch a fault,
  which times the kernel's page handling rather than the memory; jitted so
  that it runs on the step's backend and runtime (its threads, its device).

  Returns:
    ``(step, buffer)``: the jitted step (``ids`` unused, there for the
    step's signature) and the buffer to pass it first.
  """
  elements = max(1, total_bytes // (2 * F32))

  def bump(buffer, ids):
    del ids
    # Nothing else out: returning an element of the buffer too makes XLA
    # write the sum to a new buffer rather than over the donated one.
    return None, buffer + 1

  return jax.jit(bump, donate_argnums=0), jnp.zeros(elements, jnp.float32)


def rows_step(vocab, width, ids):
  """A ``step(state, ids) -> (None, state)``: the two passes over the table every sparse step makes.

  First the lookup, the C++ gather of every id's row from a donated float32
  ``[vocab, width]`` table into ``[ids, width]`` rows; then each distinct
  row of ``ids`` read and written back plus 1, in place, in one pass by the
  fused update's own kernel (SGD, one gradient row per distinct row, the
  rows sorted as the update's are). A step cannot overlap them: the second
  needs the gradient of what the first looked up. Nothing else of a step is
  in it: no model between them, no gradient of repeated ids summed (its
  ``[distinct, width]`` gradient, all -1, is read in order), no slots. Each
  pass hits the rows where they lie in a table of this size, where
  ``copy_step`` streams its bytes through one buffer: the floor of this
  machine's random access for the step's work, timed in the same run.

  Returns:
    ``(step, state)``: the jitted step and its first state, ``(table,
    gradient)`` (the gradient passed back unchanged, so that no step
    writes it), or None without the CPU kernels' library.
  """
  from embedlib import optim  # noqa: PLC0415
  from embedlib.kernels import cpu_library, gather_cpu  # noqa: PLC0415
  from embedlib.optim import fused_cpu  # noqa: PLC0415
  if jax.default_backend() != "cpu" or not cpu_library.available():
    return None
  rows = jnp.asarray(np.unique(np.asarray(ids)), jnp.int32)

  def touch(state, ids):
    table, minus_ones = state
    looked_up = gather_cpu.gather_cpu(table, ids)
    # The learning rate, 1, read from the looked-up rows (times 0): the
    # update then follows the gather, as a step's does through its gradient,
    # and XLA updates the donated table in place rather than a copy. The
    # rows are not returned: a temporary, as a step's are (an output would
    # be a fresh buffer every call, its pages faulted in).
    lr = 1.0 + 0.0 * looked_up[0, 0]
    table, _ = fused_cpu.update(optim.SparseSGD(1.0), table, {}, rows, minus_ones, lr, 0,
                                first_row=0, first_col=0, features=width)
    return None, (table, minus_ones)

  state = (jnp.zeros((vocab, width), jnp.float32), -jnp.ones((rows.shape[0], width), jnp.float32))
  return jax.jit(touch, donate_argnums=0), state


BARE_FLOOR_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bare_floor.cc")


def bare_floor(vocab, width, ids, copy_total, rounds=41, threads=2):
  """The step's two passes over the table and a copy of its bytes, in bare C++ (``bare_floor.cc``).

  ``rows_step`` times the two passes with embedlib's kernels inside XLA,
  so its figure includes their own costs (the update's dedup among them).
  This is the same work with nothing else: a gather of every id's row,
  then each distinct row read and written in place in ascending order
  (each round on the next batch of ids), on
  ``threads`` threads, and a streamed copy that reads and writes
  ``copy_total`` bytes, alternating, ``rounds`` times each, in one process.
  Their ratio is what random rows cost against a stream on this machine:
  no step that makes these two passes comes nearer a bare copy than that.

  Args:
    vocab, width: the float32 table's shape.
    ids: ``[n]`` valid ids, the step's, or ``[batches, n]``: round ``r``
      takes batch ``r % batches``, as the steps take a new batch each (one
      batch every round would find its rows in the caches from the round
      before).
    copy_total: bytes the copy reads and writes in all (``step_bytes``' total).

  Returns:
    ``{"two_passes_ms": [...], "copy_ms": [...], "distinct": int, ...}``
    (the program's JSON), or None on a machine with no C++ compiler.

  Raises:
    RuntimeError: the program failed to build, or left the table other
      than the passes must (its ``verified`` false).
  """
  from embedlib.kernels import cpu_library  # noqa: PLC0415
  cxx = cpu_library.compiler()
  if cxx is None:
    return None
  with tempfile.TemporaryDirectory() as tmp:
    binary, id_file = os.path.join(tmp, "bare_floor"), os.path.join(tmp, "ids.bin")
    # This CPU's widest vectors where the compiler knows "native" (not every
    # compiler does for every target), else its default.
    for isa in (["-march=native"], []):
      build = subprocess.run([cxx, "-O3", *isa, "-std=c++17", "-pthread", BARE_FLOOR_SOURCE,
                              "-o", binary], capture_output=True, text=True)
      if build.returncode == 0:
        break
    if build.returncode != 0:
      raise RuntimeError(f"bare_floor.cc did not build with {cxx}: {build.stderr[-2000:]}")
    batches = np.atleast_2d(np.asarray(ids, np.int32))
    batches.tofile(id_file)
    ran = subprocess.run([binary, str(vocab), str(width), id_file, str(batches.shape[1]),
                          str(int(copy_total)), str(rounds), str(threads)],
                         capture_output=True, text=True)
  if ran.returncode not in (0, 1) or not ran.stdout.strip():
    raise RuntimeError(f"bare_floor failed (exit status {ran.returncode}): {ran.stderr[-2000:]}")
  result = json.loads(ran.stdout)
  if not result["verified"]:
    raise RuntimeError("bare_floor left the table other than its two passes must: its timings "
                       "are of the wrong work; fix benchmarks/bare_floor.cc")
  return result


def copy_bytes(buffer):
  """The bytes one ``copy_step`` moves: its buffer read and written."""
  return 2 * buffer.size * buffer.dtype.itemsize


def print_limit(parts, gradient, step_ms, copy_ms, copy_moved, dram_ms, dram_moved):
  """Prints the step's bytes, the copies' speeds, and the step's distance from them.

  Medians and minima both: on a shared machine a short copy's median can
  be more the other jobs' time slices than the memory's, and the minimum
  is the sample they disturbed least.

  Args:
    parts: ``step_bytes``'s part -> bytes.
    gradient: ``row_gradient_bytes``.
    step_ms, copy_ms, dram_ms: the ms of each timed sample of the step, the
      copy of its bytes, the copy of ``DRAM_COPY_BYTES``.
    copy_moved, dram_moved: the bytes each copy reads and writes in all.
  """
  total = sum(parts.values())
  print("bytes the sparse step must touch (read + write):")
  for part, nbytes in parts.items():
    print(f"  {part:52s} {nbytes / MiB:9.2f} MiB")
  print(f"  {'total':52s} {total / MiB:9.2f} MiB")
  print(f"  (not counted: the row gradient [ids, width] written and read once, "
        f"{gradient / MiB:.2f} MiB; with it {(total + gradient) / MiB:.2f} MiB)")
  print(f"copy of the step's bytes: a buffer of {copy_moved / 2 / MiB:.2f} MiB read and written "
        f"({copy_moved / MiB:.2f} MiB moved); copy of {dram_moved / 2 / MiB:,.0f} MiB (DRAM)")
  dram_copy = f"copy of {dram_moved // (2 * MiB):,} MiB"
  print(f"  {'':8s} {'copy of its bytes':>23s} {dram_copy:>23s} {'sparse step':>23s} "
        f"{'step / copy':>12s} {'step / its bytes at DRAM rate':>30s}")
  for stat, pick in (("median", statistics.median), ("min", min)):
    step, copy, dram = pick(step_ms), pick(copy_ms), pick(dram_ms)
    dram_floor = total / (dram_moved / dram)   # the step's bytes at the DRAM copy's rate
    print(f"  {stat:8s} {rate(copy, copy_moved)} {rate(dram, dram_moved)} {rate(step, total)} "
          f"{step / copy:11.1f}x {step / dram_floor:29.1f}x ({dram_floor:.3f} ms)")


def rate(ms, nbytes):
  """``ms`` and the GB/s of ``nbytes`` in that time, 23 characters."""
  return f"{ms:8.3f} ms {nbytes / ms / 1e6:6.2f} GB/s"
