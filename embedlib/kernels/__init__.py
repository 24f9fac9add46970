"""Local (single-shard) embedding lookups: row gather and pooled bags, forward and backward.

Each lookup has its XLA ops (`xla`: the ``xla`` gather; the ``xla`` bag,
`bag_xla`, sums the same terms slot by slot), a Pallas GPU kernel (Mosaic GPU, and Triton for jax 0.10) that also runs in
interpret mode on CPU, a deterministic Pallas backward behind
``jax.custom_vjp``, a C++ gather and pooled bag for the CPU
(`gather_cpu`, `bag_cpu`, built on first use by `cpu_library`), and a dispatcher
(``kernel=`` one of ``options.KERNELS``) that stages each platform's kernel
in the program (`platforms`), so lowering picks it. Strategies call these on local shards
inside ``jax.shard_map``. Invalid ids (negative or ``>= num_embeddings``) read
zero rows, count as bag padding and receive no gradient (``embedlib.invalid_ids``).
What all of them are tested against is `reference`, the specification
(``gather_reference``, ``bag_reference``, ``scores_reference``: for tests and
benchmarks; the library never calls it).

Beside the lookups, `interaction` runs DLRM's dot interaction of separate
vectors as a C++ kernel on CPU (``models.dot_interaction`` calls it).

>>> import jax.numpy as jnp
>>> from embedlib import kernels
>>> table = jnp.arange(6.0).reshape(3, 2)
>>> kernels.gather(table, jnp.array([2, -1])).tolist()
[[4.0, 5.0], [0.0, 0.0]]
"""

from embedlib.kernels.dispatch import (
    bag,
    check_kernel,
    gather,
    pallas_backend,
    plan,
    resolve_kernel,
    shard_map_check_vma,
    target_platform,
)
from embedlib.kernels.bags import bag_coefficients, check_combiner, ragged_to_padded
from embedlib.kernels.reference import bag_reference, gather_reference, scores_reference
from embedlib.kernels.xla import scores

__all__ = [
    "bag",
    "bag_coefficients",
    "bag_reference",
    "check_combiner",
    "check_kernel",
    "gather",
    "gather_reference",
    "pallas_backend",
    "plan",
    "ragged_to_padded",
    "resolve_kernel",
    "scores",
    "scores_reference",
    "shard_map_check_vma",
    "target_platform",
]
