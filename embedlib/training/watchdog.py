"""A step that makes no progress ends the run, naming the program and the collective.

A device program stuck in a collective never returns to Python: the main
thread waits in ``block_until_ready``, where neither an exception nor a
signal handler reaches it, and XLA:CPU, after its collective timeout
(``--xla_cpu_collective_call_terminate_timeout_seconds``, 40 s by default),
aborts the process with a C++ stack trace. ``Watchdog`` watches from a
thread of its own:

- The loop says what it waits on (``waiting``: the program and the step)
  and ``beat`` s when it gets on. A wait that has gone ``limit_s`` without a
  beat, or that XLA reports stuck (its "This thread has been waiting for
  `all gather ...` ... may be stuck" warning on stderr, relayed in the
  message) and that is not over shortly before XLA would abort, ends the
  run with exit status ``STUCK``: the message names the program, the step,
  the collective and the newest checkpoint, which the exit leaves as it is.
- SIGTERM or SIGINT during a wait that is then not over within ``grace_s``
  ends the run at once, saying so (exit status 128 + the signal): the
  training loop's own stop (``signals.StopSignals``: a checkpoint after the
  step) needs the step to finish. The signal's arrival is read from
  Python's wakeup fd, which the C handler writes even while the main
  thread is blocked.

The first wait of each program compiles it: only XLA's report, not
``limit_s``, counts there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
import time

log = logging.getLogger(__name__)

#: Exit status of a run ended because a wait made no progress.
STUCK = 3
#: XLA:CPU's line about a collective some device has not reached.
_XLA_STUCK = re.compile(r"waiting for `(?P<collective>[^`]*)`.*may be stuck")
_XLA_TIMEOUTS = {"warn": ("xla_cpu_collective_call_warn_stuck_timeout_seconds", 20),
                 "terminate": ("xla_cpu_collective_call_terminate_timeout_seconds", 40)}


def xla_timeout(which: str, flags: str | None = None) -> int:
  """XLA:CPU's ``warn`` or ``terminate`` collective timeout in seconds, from ``XLA_FLAGS``.

  >>> xla_timeout("terminate", ""), xla_timeout("warn", "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60")
  (40, 60)
  """
  name, default = _XLA_TIMEOUTS[which]
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  found = re.findall(rf"--{name}=(\d+)", flags)
  return int(found[-1]) if found else default


class Watchdog:
  """Ends the run when the program the loop waits on makes no progress (see the module doc).

  Args:
    limit_s: seconds a wait may go without a ``beat`` (after its program's
      first wait); 0 turns the limit off (XLA's report still counts).
    grace_s: seconds a wait may go on after SIGTERM / SIGINT.
    relay_stderr: read fd 2 through a pipe, passing everything on, to find
      XLA's stuck-collective lines.
    newest: returns the newest checkpoint in words, for the message (it
      runs while the loop is stuck: a directory listing, not a restore).
    reported_s: seconds from XLA's stuck report to the end of the run;
      None: 5 s before XLA's own abort (``xla_timeout``).
    exit: what ends the process (``os._exit``; tests pass their own).
    clock: seconds, monotonic (tests pass their own and call ``check``).
  """

  def __init__(self, *, limit_s: float = 600.0, grace_s: float = 5.0, relay_stderr: bool = True,
               newest=lambda: "unknown", reported_s: float | None = None, exit=os._exit,
               clock=time.monotonic):
    self.limit_s = float(limit_s)
    self.grace_s = float(grace_s)
    if reported_s is None:
      # XLA aborts the process `terminate` s into a stuck collective, `warn` s
      # after it first reports it.
      reported_s = max(0.0, xla_timeout("terminate") - xla_timeout("warn") - 5)
    self.reported_s = float(reported_s)
    self._relay = relay_stderr
    self._exit = exit
    self._clock = clock
    self._lock = threading.Lock()
    self._wait = None       # (program, step, first) while the loop waits
    self._beat = clock()
    self._seen = set()      # programs waited on before: compiled
    self._stuck_line = None  # XLA's last stuck-collective line, and when
    self._stuck_at = 0.0
    self._signal = None     # (name, when) of a stop signal during a wait
    self._newest = newest
    self._stop = threading.Event()
    self._threads = []
    self._stderr = None     # the process's own stderr, while fd 2 is the pipe
    self._wakeup = None     # (read fd, the wakeup fd it replaced)

  # -- what the loop calls -----------------------------------------------------

  @contextlib.contextmanager
  def waiting(self, program: str, step: int):
    """Marks a wait on ``program`` at ``step``; a clean end of the block is a beat."""
    with self._lock:
      first = program not in self._seen
      self._seen.add(program)
      self._wait, self._beat = (program, step, first), self._clock()
      self._stuck_line = None
    try:
      yield
    finally:
      with self._lock:
        self._wait, self._beat = None, self._clock()

  def beat(self) -> None:
    """The program waited on got on (an eval batch, say)."""
    with self._lock:
      self._beat = self._clock()

  # -- the watching --------------------------------------------------------------

  def __enter__(self):
    if self._relay:
      self._start_relay()
    if threading.current_thread() is threading.main_thread():
      self._start_wakeup()
    self._threads.append(threading.Thread(target=self._watch, name="watchdog", daemon=True))
    self._threads[-1].start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    read = None
    if self._wakeup is not None:
      read, write, previous = self._wakeup
      signal.set_wakeup_fd(previous)
      # A byte that is no signal, then the write end closed, wake the signal
      # thread's read (the byte also where a forked child holds the write end
      # open). Closing the read end under a blocked read would not wake it, and
      # its number could be reused by another file while the thread reads it.
      with contextlib.suppress(OSError):  # a full pipe: the thread has bytes to read
        os.write(write, b"\0")
      os.close(write)
      self._wakeup = None
    if self._stderr is not None:
      os.dup2(self._stderr, 2)  # closes the pipe's last writer: the relay sees its end
      os.close(self._stderr)
      self._stderr = None
    for t in self._threads:
      t.join(timeout=5)
    self._threads = []
    if read is not None:
      os.close(read)
    return False

  def _start_relay(self):
    read, write = os.pipe()
    self._stderr = os.dup(2)
    os.dup2(write, 2)
    os.close(write)
    out = self._stderr

    def relay():
      pending = b""
      while True:
        chunk = os.read(read, 65536)
        if not chunk:
          break
        # A closed stderr must not stop the draining: a full pipe would block every writer.
        with contextlib.suppress(OSError):
          os.write(out, chunk)
        pending = (pending + chunk)[-65536:]
        *lines, pending = pending.split(b"\n")
        for line in lines:
          self.stderr_line(line.decode(errors="replace"))
      os.close(read)

    self._threads.append(threading.Thread(target=relay, name="stderr-relay", daemon=True))
    self._threads[-1].start()

  def _start_wakeup(self):
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    self._wakeup = (read, write, previous)

    def signals():
      while not self._stop.is_set():
        data = os.read(read, 64)
        if not data:  # the write end closed on exit
          return
        for number in data:
          if number in (signal.SIGTERM, signal.SIGINT):
            self.stop_signal(signal.Signals(number).name)

    self._threads.append(threading.Thread(target=signals, name="signal-watch", daemon=True))
    self._threads[-1].start()

  def _watch(self):
    while not self._stop.wait(0.2):
      self.check()

  def stop_signal(self, name: str) -> None:
    """SIGTERM or SIGINT (``name``) arrived: counts against the current wait, if any."""
    with self._lock:
      if self._wait is not None and self._signal is None:
        self._signal = (name, self._clock())

  def check(self) -> None:
    """One look at the wait: ends the run if it is stuck (the watch thread's, every 0.2 s)."""
    now = self._clock()
    with self._lock:
      wait, since = self._wait, now - self._beat
      line, signalled = self._stuck_line, self._signal
      stuck_for = now - self._stuck_at if line else 0.0
      if wait is None:
        self._signal = None  # a signal between waits: the loop's own stop handles it
        return
    program, step, first = wait
    if signalled is not None and now - signalled[1] >= self.grace_s:
      self._end(
          f"{signalled[0]} during {program} at step {step}, which made no progress for "
          f"{since:.0f} s{self._collective(line)}: stopping at once, without a checkpoint. "
          f"The newest checkpoint ({self._newest()}) is intact; rerun the same command to "
          "resume from it.", 128 + signal.Signals[signalled[0]].value)
      return
    reported = line is not None and stuck_for >= self.reported_s
    timed_out = self.limit_s > 0 and not first and since > self.limit_s
    if reported or timed_out:
      self._end(
          f"{program} at step {step} made no progress for {since:.0f} s"
          f"{self._collective(line)}. The newest checkpoint ({self._newest()}) is intact; "
          f"exiting with status {STUCK}. Rerun the same command to resume from it; if it "
          "stops at the same place again, report it with this message.", STUCK)

  def stderr_line(self, text: str) -> None:
    """A line written to stderr (the relay's): XLA's report of a stuck collective is kept."""
    if _XLA_STUCK.search(text):
      with self._lock:
        self._stuck_line, self._stuck_at = text.strip(), self._clock()

  @staticmethod
  def _collective(line) -> str:
    """XLA's stuck collective (kind and rendezvous key) out of its line, for the message."""
    if line is None:
      return ""
    return (f"; XLA reports {_XLA_STUCK.search(line).group('collective')} stuck: a device "
            "never reached it")

  def _end(self, message: str, status: int) -> None:
    self._stop.set()
    if self._stderr is None:
      log.error("%s", message)
    else:  # straight to the process's stderr: the relay may not pass a log line on in time
      with contextlib.suppress(OSError):
        os.write(self._stderr, f"{time.strftime('%H:%M:%S')} error: {message}\n".encode())
    self._exit(status)
