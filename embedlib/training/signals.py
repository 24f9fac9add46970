"""SIGTERM and SIGINT as a request to stop after the current step.

Preemption on shared clusters sends SIGTERM, and a user presses Ctrl-C: both
should end in a checkpoint at the step reached, not in a traceback or a
half-written save. The handler only records the request; the training loop
checks ``requested`` between steps, saves, and returns. A second signal of
either kind stops at once (``KeyboardInterrupt``), for a save that hangs.
"""

from __future__ import annotations

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

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.requested is not None:
      raise KeyboardInterrupt(f"{name} received twice: stopping without a final checkpoint")
    self.requested = name
    log.warning("received %s: stopping after this step with a checkpoint "
                "(send it again to stop at once, without one)", name)
