"""A choice between two implementations that tests and benchmarks can force.

The fused and sorted updates are chosen when a step is traced (by platform
and by what the kernel supports); a `TraceSwitch` lets a block force the
choice. jax caches traced programs, so entering and leaving a block clears
its caches: a function jitted before is traced again with the new choice.
"""

from __future__ import annotations

import contextlib

import jax


class TraceSwitch:
  """A stack of forced choices: `forced` is the innermost block's, or None."""

  def __init__(self):
    self._stack: list[bool | str] = []

  @contextlib.contextmanager
  def use(self, enabled):
    """Within the block, `forced` is ``enabled`` (a bool, or a name a switch defines). Nests."""
    self._stack.append(enabled if isinstance(enabled, str) else bool(enabled))
    jax.clear_caches()
    try:
      yield
    finally:
      self._stack.pop()
      jax.clear_caches()

  def forced(self) -> bool | str | None:
    return self._stack[-1] if self._stack else None
