"""Where ``kernel="auto"`` runs XLA's ops on a GPU instead of the Pallas kernels.

``auto`` runs the Pallas kernels on a GPU except for the shapes listed in
`XLA_FASTER`: a shape goes there when a GPU run of
``benchmarks/gpu_session.sh`` measures the Pallas kernel slower than XLA's
ops for it (``benchmarks/README.md`` gives the figures). No GPU run has
measured the kernels yet, so the table is empty. Tables the Mosaic kernels
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


#: The measured exceptions (empty: no GPU measurement yet).
XLA_FASTER: tuple[Slower, ...] = ()


def prefers_xla(kind: str, table_shape, dtype, ids_shape, table=XLA_FASTER) -> bool:
  """Whether ``auto`` on a GPU should run XLA's ops for this lookup.

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
  return any(
      r.kind == kind and r.dtype == name and r.features[0] <= features <= r.features[1]
      and r.num_ids[0] <= num_ids <= r.num_ids[1]
      for r in table
  )
