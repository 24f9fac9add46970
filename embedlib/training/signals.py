"""SIGTERM and SIGINT as a request to stop after the current step.

Preemption on shared clusters sends SIGTERM, and a user presses Ctrl-C: both
should end in a checkpoint at the step reached, not in a traceback or a
half-written save. The handler only records the request; the training loop
checks ``requested`` between steps, saves, and returns. A second signal of
either kind stops at once (``KeyboardInterrupt``), except inside ``deferred()``
(a checkpoint being started or waited for), where it stops when the block
ends; a third stops at once there too, for a save that hangs.

Why checkpoint calls defer it: orbax starts a save's write and, once that is
on disk, removes the checkpoints past ``max_to_keep`` in a thread the save
starts. An interrupt in between (or one that breaks the main thread's join of
that thread) left the new checkpoint written and the old one kept: one more
than ``max_to_keep``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
  """Context manager that turns SIGTERM/SIGINT into ``requested``; restores the old handlers.

  >>> import os, signal
  >>> with StopSignals() as stop:
  ...   os.kill(os.getpid(), signal.SIGTERM)
  ...   stop.requested
  'SIGTERM'

  Outside the main thread (where Python can't install handlers) it does
  nothing and ``requested`` stays None.
  """

  def __init__(self, signals=STOP_SIGNALS):
    self.signals = tuple(signals)
    self.requested: str | None = None
    self._previous = {}
    self._deferring = False
    self._held: str | None = None  # a second signal received inside ``deferred()``

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in self.signals:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
    return False

  @contextlib.contextmanager
  def deferred(self):
    """Holds a second signal until the block ends, then raises its ``KeyboardInterrupt``.

    >>> import os, signal
    >>> with StopSignals() as stop:
    ...   os.kill(os.getpid(), signal.SIGTERM)
    ...   try:
    ...     with stop.deferred():
    ...       os.kill(os.getpid(), signal.SIGTERM)
    ...       print("the block ran to its end")
    ...   except KeyboardInterrupt as e:
    ...     print(e)
    the block ran to its end
    SIGTERM received twice: stopping without a final checkpoint
    """
    self._deferring = True
    try:
      yield
    finally:
      self._deferring = False
    if self._held is not None:
      name, self._held = self._held, None
      raise KeyboardInterrupt(f"{name} received twice: stopping without a final checkpoint")

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.requested is not None:
      if self._deferring and self._held is None:
        self._held = name
        log.warning("received %s again during a checkpoint write: stopping once it is on "
                    "disk (send it a third time to stop at once)", name)
        return
      raise KeyboardInterrupt(f"{name} received twice: stopping without a final checkpoint")
    self.requested = name
    log.warning("received %s: stopping after this step with a checkpoint "
                "(send it again to stop at once, without one)", name)
