"""Where ``kernel="auto"`` runs XLA's ops on a GPU instead of the Pallas kernels.

``auto`` runs the Pallas kernels on a GPU except for the shapes listed in
`XLA_FASTER`: a shape goes there when a GPU run of
``benchmarks/gpu_session.sh`` measures the Pallas kernel slower than XLA's
ops for it (``benchmarks/README.md``, "GPU lookup kernels", gives the
figures). The first run, on an H200, measured the Mosaic GPU kernels slower
than XLA's ops at every shape it timed (gathers 0.34x to 0.54x XLA's speed,
bags 0.13x to 0.30x: each row is its own TMA copy, issued one after another
by one thread, so the cost grows with the ids whatever the width), and the
Triton kernels slower at most; so every gather and bag of float32 and
16-bit floats runs XLA's ops, until a run measures a shape where a kernel wins.
``kernel="pallas"`` (or ``"mosaic"`` / ``"triton"``) still runs the
kernels, whose table gradient is a deterministic segment sum; XLA's is a
scatter-add, which a GPU runs with atomics. Tables the Mosaic kernels
cannot take at all (`mosaic.supports`) run XLA's ops whatever this says.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Slower:
  """Lookups of ``kind`` where the Pallas kernel was measured slower than XLA.

  A lookup matches when its kind and dtype match and its feature width and
  id count lie in the given closed ranges.
  """

  kind: str  # "gather" or "bag"
  dtype: str  # e.g. "float32"
  features: tuple[int, int]
  num_ids: tuple[int, int]


_EVERY_WIDTH, _EVERY_COUNT = (1, 2**31), (1, 2**62)

#: The measured exceptions: on an H200, gathers and bags of float32 and
#: bfloat16 (widths 64 and 128, 65,536 ids, uniform and Zipf) ran faster as
#: XLA's ops, every one of them. float16 is listed with bfloat16: the same
#: copies of the same bytes.
XLA_FASTER: tuple[Slower, ...] = tuple(
    Slower(kind, dtype, _EVERY_WIDTH, _EVERY_COUNT)
    for kind in ("gather", "bag") for dtype in ("float32", "bfloat16", "float16"))


def prefers_xla(kind: str, table_shape, dtype, ids_shape, table=None) -> bool:
  """Whether ``auto`` on a GPU should run XLA's ops for this lookup (by ``table``, default `XLA_FASTER`).

  >>> rule = Slower("gather", "float32", (1, 8), (0, 10**9))
  >>> prefers_xla("gather", (100, 4), jnp.float32, (64,), table=(rule,))
  True
  >>> prefers_xla("gather", (100, 64), jnp.float32, (64,), table=(rule,))
  False
  """
  features = table_shape[1]
  num_ids = 1
  for d in ids_shape:
    num_ids *= d
  name = jnp.dtype(dtype).name
  table = XLA_FASTER if table is None else table
  return any(
      r.kind == kind and r.dtype == name and r.features[0] <= features <= r.features[1]
      and r.num_ids[0] <= num_ids <= r.num_ids[1]
      for r in table
  )
