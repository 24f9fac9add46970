"""The scoped tape through which lookups report themselves to ``embedlib.optim``.

``embedlib.optim.value_and_grad`` takes gradients with respect to the rows a
batch looked up rather than whole tables. To do that it must see every
lookup of a sparse table made while the loss runs. It opens a tape for the
duration of one trace of the loss (``recording``), and ``ShardedEmbed``
reports each lookup to the tape in context (``active``): nothing else reads
or writes it.

The tape lives in a ``contextvars.ContextVar``, so it is scoped to the code
under ``recording`` (and to its thread), never a module-level list that
other code appends to. Only the protocol is defined here, below the
modules that report; the tape itself is ``embedlib.optim``'s.

A tape is tied to the trace it was opened in. A lookup traced elsewhere
(inside a ``jax.jit``, ``nnx.jit``, ``vmap`` or ``scan`` nested in the loss)
could only hand back values of that inner trace, which must not escape it;
``ShardedEmbed`` raises instead (``check_trace``).
"""

from __future__ import annotations

import contextlib
import contextvars
import typing as tp

import jax.extend

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("embedlib_tape", default=None)


class Tape(tp.Protocol):
  """What a lookup reports to (implemented by ``embedlib.optim``)."""

  def lookup(self, module, ids, rows, coefficients=None):
    """Records one lookup of ``module``; returns the rows to use instead of ``rows``."""

  def attend(self, module) -> None:
    """Records a dense use of ``module``'s whole table."""


def current_trace():
  """An opaque token of the JAX trace this code runs under."""
  return jax.extend.core.get_opaque_trace_state(convention="nnx")


def active() -> Tape | None:
  """The tape recording the lookups of the code running now, or None."""
  return _ACTIVE.get()


@contextlib.contextmanager
def recording(tape: Tape):
  """Makes ``tape`` the active tape inside the ``with`` block."""
  token = _ACTIVE.set(tape)
  try:
    yield tape
  finally:
    _ACTIVE.reset(token)
