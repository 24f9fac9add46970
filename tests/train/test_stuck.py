"""A step that makes no progress ends the run cleanly (``embedlib.training.watchdog``).

The hangs are injected (a step that never returns), not real deadlocks: in
process against ``Watchdog`` with its exit replaced, and through ``python -m
train`` with a step that blocks after writing XLA's stuck-collective line.
"""

import os
import signal
import subprocess
import sys
import threading

import pytest

from embedlib.training import watchdog
from embedlib.training.signals import StopSignals
from tests import xla_env

ROOT = xla_env.ROOT
#: XLA:CPU's report of a collective a device never reached, as it prints it.
XLA_LINE = ("E0101 00:00:20.000000 1 rendezvous.cc:116] [id=0] This thread has been waiting "
            "for `all gather RendezvousKey{run_id=RunId: 7, global_devices=[0, 1, 2, 3, 4, "
            "5, 6, 7], num_local_participants=8, collective_op_kind=cross_module, op_id=1}` "
            "for 20 seconds and may be stuck. Expected 8 threads to join the rendezvous, but "
            "not all of them arrived on time.")
#: How long a test waits for what must happen (a bound against hanging the suite, not a timing).
PATIENCE = 120


class _Exit:
  """Stands in for ``os._exit``: records the status."""

  def __init__(self):
    self.status, self.done = None, threading.Event()

  def __call__(self, status):
    self.status = status
    self.done.set()


class _Clock:
  """A clock the test moves: ``check`` then sees exactly this much time pass."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _dog(**kw):
  """A ``Watchdog`` with neither threads nor a stderr relay: the test calls ``check``."""
  clock, end = _Clock(), _Exit()
  dog = watchdog.Watchdog(relay_stderr=False, exit=end, clock=clock,
                          newest=lambda: "step 4, in /runs/x/checkpoints", **kw)
  return dog, clock, end


def test_a_wait_past_the_limit_ends_the_run_naming_the_program_and_checkpoint(caplog):
  dog, clock, end = _dog(limit_s=30)
  with dog.waiting("train_step", 1):
    clock.now += 300  # the first call compiles: no limit
    dog.check()
  with dog.waiting("train_step", 5):
    clock.now += 29
    dog.check()
    assert end.status is None
    clock.now += 2
    dog.check()
  assert end.status == watchdog.STUCK
  assert "train_step at step 5 made no progress for 31 s" in caplog.text
  assert "newest checkpoint (step 4, in /runs/x/checkpoints) is intact" in caplog.text
  assert "exiting with status 3" in caplog.text


def test_beats_keep_a_long_eval_going_and_nothing_counts_between_waits():
  dog, clock, end = _dog(limit_s=30)
  for step in (2, 4):
    with dog.waiting("the eval (eval_step)", step):
      for _ in range(10):  # 200 s in all, a batch every 20 s
        clock.now += 20
        dog.beat()
        dog.check()
  clock.now += 1000  # between waits (a slow host-side log write, say)
  dog.check()
  assert end.status is None


def test_xla_reporting_a_collective_stuck_ends_the_run_and_names_it(caplog):
  dog, clock, end = _dog(limit_s=0, reported_s=15)
  with dog.waiting("train_step", 1):  # even while compiling: XLA only reports running programs
    dog.stderr_line(XLA_LINE)
    clock.now += 14
    dog.check()
    assert end.status is None
    clock.now += 1
    dog.check()
  assert end.status == watchdog.STUCK
  assert ("XLA reports all gather RendezvousKey{run_id=RunId: 7, global_devices=[0, 1, 2, 3, "
          "4, 5, 6, 7], num_local_participants=8, collective_op_kind=cross_module, op_id=1} "
          "stuck: a device never reached it") in caplog.text


def test_xla_lines_reach_stderr_through_the_relay_and_are_read(capfd):
  end = _Exit()
  with watchdog.Watchdog(limit_s=0, reported_s=0, exit=end) as dog:
    with dog.waiting("train_step", 7):
      os.write(2, (XLA_LINE + "\n").encode())  # as XLA writes it, to fd 2
      assert end.done.wait(PATIENCE)
  assert end.status == watchdog.STUCK
  assert XLA_LINE in capfd.readouterr().err  # passed on as it came


def test_a_stop_signal_during_a_wait_ends_the_run_after_the_grace(caplog):
  dog, clock, end = _dog(limit_s=0, grace_s=5)
  with dog.waiting("pipelined_train_step", 3):
    dog.stop_signal("SIGTERM")
    clock.now += 4
    dog.check()
    assert end.status is None  # a step that ends within the grace saves and stops as usual
    clock.now += 1
    dog.check()
  assert end.status == 128 + signal.SIGTERM
  assert "SIGTERM during pipelined_train_step at step 3" in caplog.text
  assert "without a checkpoint" in caplog.text


def test_sigterm_reaches_the_watchdog_while_the_main_thread_waits():
  end = _Exit()
  with StopSignals() as stop, watchdog.Watchdog(limit_s=0, grace_s=0, relay_stderr=False,
                                                exit=end) as dog:
    with dog.waiting("train_step", 3):
      os.kill(os.getpid(), signal.SIGTERM)
      assert end.done.wait(PATIENCE)
  assert stop.requested == "SIGTERM" and end.status == 128 + signal.SIGTERM


def test_a_run_that_ends_leaves_no_watching_thread_and_no_open_pipe():
  """The signal thread's blocked read ends with the run, not after the join's timeout.

  Its read end was closed under the read, which neither woke it nor kept the
  number from being reused while it read; a run's end waited out the timeout.
  """
  fds = set(os.listdir("/proc/self/fd"))
  with watchdog.Watchdog(limit_s=0, exit=_Exit()) as dog:
    threads = list(dog._threads)  # pylint: disable=protected-access
    assert {t.name for t in threads} == {"stderr-relay", "signal-watch", "watchdog"}
  assert not [t.name for t in threads if t.is_alive()]
  assert set(os.listdir("/proc/self/fd")) == fds


def test_the_xla_timeouts_are_read_from_the_flags():
  assert watchdog.xla_timeout("terminate", "") == 40
  flags = xla_env.flags(8)  # the suite's raised ones
  assert watchdog.xla_timeout("terminate", flags) == 300
  assert watchdog.xla_timeout("warn", flags) == 60


# The trainer with a step that blocks from its HANG-th call on, after writing
# XLA's stuck line: checkpoints every 2 steps, so steps 2 and 4 are saved. The
# model is the smoke DLRM with one table of its eight: the watchdog watches the
# same loop, and one table is less to compile.
_HANGING_TRAINER = f"""
import os, sys, threading, runpy
from flax import nnx
real, calls = nnx.cached_partial, [0]
def cached_partial(f, *args, **kw):
  step = real(f, *args, **kw)
  def call(*a, **k):
    calls[0] += 1
    if calls[0] == int(os.environ["HANG"]):
      os.write(2, ({XLA_LINE!r} + "\\ninjected hang\\n").encode())
      threading.Event().wait()
    return step(*a, **k)
  return call
nnx.cached_partial = cached_partial
sys.argv = ["train"] + sys.argv[1:]
runpy.run_module("train", run_name="__main__")
"""


def _trainer(workdir, *flags, hang=5):
  env = dict(xla_env.subprocess_env(8), HANG=str(hang))
  return subprocess.Popen(
      [sys.executable, "-c", _HANGING_TRAINER, "--config", "configs/quickstart.py:smoke",
       f"--workdir={workdir}", "--config.num_train_steps=8", "--config.checkpoint_every=2",
       "--config.eval_every=100", "--config.data.table_sizes=(100,)",
       "--config.data.bag_sizes=(1,)", *flags],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _checkpoints(workdir):
  return sorted(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())


def test_a_stuck_step_ends_the_run_with_status_3_and_the_checkpoint_intact(tmp_path):
  proc = _trainer(tmp_path, "--stuck_after=2")
  _, err = proc.communicate(timeout=PATIENCE * 5)
  assert proc.returncode == watchdog.STUCK, err[-3000:]
  assert "train_step at step 5 made no progress" in err
  assert "XLA reports all gather RendezvousKey{run_id=RunId: 7" in err  # its line, read
  assert f"newest checkpoint (step 4, in {tmp_path / 'checkpoints'}) is intact" in err
  assert _checkpoints(tmp_path) == [2, 4]
  assert "Traceback" not in err and "Fatal Python error" not in err


@pytest.mark.slow
def test_sigterm_during_a_stuck_step_exits_at_once_saying_so(tmp_path):
  proc = _trainer(tmp_path, "--stuck_after=0")
  err = []
  for line in proc.stderr:  # the step has hung once this is printed
    err.append(line)
    if line.startswith("injected hang"):
      break
  proc.send_signal(signal.SIGTERM)
  _, rest = proc.communicate(timeout=PATIENCE)
  err = "".join(err) + rest
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert "SIGTERM during train_step at step 5" in err
  assert "stopping at once, without a checkpoint" in err
  assert _checkpoints(tmp_path) == [2, 4]
