"""Tables past 2**31 elements: no kernel computes a row offset in 32 bits.

A 100M x 64 float32 table (6.4e9 elements, 25.6 GB) is traced and lowered
for CUDA as an abstract shape (nothing is allocated), and each kernel's own
module is read:

- Mosaic GPU (gather, bag): the table stays a 2-D ``memref`` and every row
  copy is a 2-D TMA copy at (row, column) coordinates, so no flat element
  offset exists (the backward's kernel reads only the small cotangent; its
  sums reach the table through XLA's scatter at row indices);
- Triton (gather, bag, backward): every pointer into the table is offset by
  a 64-bit integer (Pallas's Triton lowering switches to i64 offsets for
  arrays past 2**32 bytes, and the kernels hand it non-negative row indices);
- XLA's ops (``kernel="xla"``) index the table by row (``slice_sizes`` of
  one row).
"""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from embedlib import kernels
from embedlib.kernels.lowering import cuda_lowering_text

S = jax.ShapeDtypeStruct
ROWS, FEATURES = 100_000_000, 64
TABLE = S((ROWS, FEATURES), jnp.float32)
IDS = S((512,), jnp.int32)
BAG_IDS = S((64, 8), jnp.int32)
assert ROWS * FEATURES > 2**32


def gather_grad(kernel):
  return jax.grad(lambda t, i: kernels.gather(t, i, kernel=kernel).sum()), (TABLE, IDS)


LOOKUPS = {
    "gather": lambda kernel: (lambda t, i: kernels.gather(t, i, kernel=kernel), (TABLE, IDS)),
    "bag": lambda kernel: (lambda t, i: kernels.bag(t, i, combiner="mean", kernel=kernel),
                           (TABLE, BAG_IDS)),
    "gather grad": gather_grad,
}


def mosaic_modules(fn, args, monkeypatch):
  """Text of each Mosaic GPU module the CUDA lowering of ``fn`` builds."""
  from jax.experimental.mosaic.gpu import core

  seen = []
  serde = core._run_serde_pass

  def capture(module, **kwargs):
    seen.append(str(module))
    return serde(module, **kwargs)

  monkeypatch.setattr(core, "_run_serde_pass", capture)
  cuda_lowering_text(fn, *args)
  return seen


def ops(text, name):
  """Each ``stablehlo.<name>`` op of ``text``, through its type signature (ops span lines)."""
  pieces = re.split(rf'(?="stablehlo\.{name}"\(|stablehlo\.{name} )', text)[1:]
  return [piece.split(") -> ")[0] for piece in pieces]


def tensor_copies_2d(text) -> int:
  """TMA tensor copies with two coordinates (jax 0.12's PTX, or jax 0.10's nvvm op)."""
  return text.count("cp.async.bulk.tensor.2d") + len(re.findall(r"box\[%\w+, %\w+\]", text))


@pytest.mark.parametrize("lookup", ["gather", "bag"])
def test_mosaic_kernels_copy_rows_by_row_and_column(lookup, monkeypatch):
  modules = mosaic_modules(*LOOKUPS[lookup]("mosaic"), monkeypatch)
  assert len(modules) == 1
  (text,) = modules
  assert f"memref<{ROWS}x{FEATURES}xf32" in text            # the table, 2-D
  assert not re.search(rf"memref<{ROWS * FEATURES}x", text)  # never flattened
  assert tensor_copies_2d(text) > 0                          # (row, column) copies


def test_mosaic_backward_leaves_the_table_to_a_row_scatter(monkeypatch):
  fn, args = gather_grad("mosaic")
  modules = [m for m in mosaic_modules(fn, args, monkeypatch) if "segment_sum" in m]
  assert len(modules) == 1 and f"{ROWS}x" not in modules[0]  # the kernel sees no table
  scatters = [op for op in ops(cuda_lowering_text(fn, *args), "scatter")
              if f"tensor<{ROWS}x{FEATURES}xf32>" in op]
  # Row indices, one row per update, each row written once.
  assert scatters
  assert all("inserted_window_dims = [0]" in op and "unique_indices = true" in op
             for op in scatters)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("lookup", sorted(LOOKUPS))
def test_triton_kernels_offset_table_pointers_in_64_bits(lookup, monkeypatch):
  fn, args = LOOKUPS[lookup]("triton")
  debug_call = pl.pallas_call

  def with_debug(*a, **k):
    return debug_call(*a, **dict(k, debug=True))  # prints the kernel's Triton IR

  monkeypatch.setattr(pl, "pallas_call", with_debug)
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    cuda_lowering_text(fn, *args)
  # Offsets of pointers into float32 arrays, by access: the table is read
  # ("get") by the forward kernels and written ("swap") by the backward's.
  access = "swap" if lookup.endswith("grad") else "get"
  offsets = re.findall(rf"tt\.addptr .*!tt\.ptr<f32>>, tensor<[0-9x]*x(i\d+)> \"{access}:",
                       printed.getvalue())
  assert offsets and set(offsets) == {"i64"}, offsets


@pytest.mark.parametrize("lookup", sorted(LOOKUPS))
def test_xla_ops_index_the_table_by_row(lookup):
  fn, args = LOOKUPS[lookup]("xla")
  text = cuda_lowering_text(fn, *args)
  table = f"tensor<{ROWS}x{FEATURES}xf32>"
  gathers = [op for op in ops(text, "gather") if table in op]
  scatters = [op for op in ops(text, "scatter") if table in op]
  assert gathers or scatters
  assert all(f"slice_sizes = array<i64: 1, {FEATURES}>" in op for op in gathers), gathers
  assert all("inserted_window_dims = [0]" in op for op in scatters), scatters
