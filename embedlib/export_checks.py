"""The ``jax.export`` safety checks a program holding embedlib's kernels must disable.

``jax.export.export`` refuses custom calls whose targets jax doesn't promise
to keep compatible: embedlib's CPU kernels are FFI targets of its own C++
library (``kernels/cpu_library.py``), and the Triton kernels (Pallas on GPU
with jax 0.10) lower to Triton IR, which has no stability guarantee. A
program exported with these checks disabled runs only where the same
embedlib (for the CPU targets, registered by importing it) and a
compatible jax are installed.
"""

from __future__ import annotations

from jax import export

from embedlib.kernels import cpu_library, lowering

#: Every custom call target embedlib's kernels may emit. Mosaic GPU's is on
#: jax's list of stable targets today; it is here so the list stays whole.
CUSTOM_CALL_TARGETS: tuple[str, ...] = (
    *cpu_library.TARGETS, lowering.TRITON_CALL, lowering.MOSAIC_GPU_CALL)


def export_disabled_checks() -> list[export.DisabledSafetyCheck]:
  """``disabled_checks`` for ``jax.export.export`` of a program using embedlib's kernels.

  >>> import embedlib
  >>> len(embedlib.export_disabled_checks()) == len(CUSTOM_CALL_TARGETS)
  True

  Returns:
    One ``jax.export.DisabledSafetyCheck.custom_call(target)`` per target in
    ``CUSTOM_CALL_TARGETS``.
  """
  return [export.DisabledSafetyCheck.custom_call(t) for t in CUSTOM_CALL_TARGETS]
