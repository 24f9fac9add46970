"""The line protocol between a benchmark and its timing workers (pure Python).

A worker is a long-lived process holding one model, its optimizer and the
batches; the benchmark asks every worker in turn to run ``steps`` steps, so
the sides interleave in one run and machine noise hits them alike. Shared by
the JAX workers (``benchmarks/train_dlrm.py --worker``) and the PyTorch ones
(``benchmarks/peers/*.py``, which run in the ``.peers`` venv and import
nothing from embedlib). Messages are single stdout lines ``@@<kind> <json>``;
anything else on stdout is ignored by the reader, stderr goes to a log.

Worker side::

    serve(run_steps, info)   # run_steps(n) -> last loss (float)

Benchmark side: ``Worker(name, argv, env)``, ``.ready()``, ``.run(steps)``,
``.close()`` (returns the worker's peak RSS).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

PREFIX = "@@"


def peak_rss_mib() -> float:
  """This process's peak resident set size, in MiB.

  From ``VmHWM`` where Linux has it: ``ru_maxrss`` survives ``exec``, so in
  a worker it would also count the benchmark's peak before the worker
  started.
  """
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024   # kB
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _send(kind: str, payload: dict) -> None:
  sys.stdout.write(f"{PREFIX}{kind} {json.dumps(payload)}\n")
  sys.stdout.flush()


def cycle(items):
  """A function returning ``items[0]``, ``items[1]``, ... in turn, from the first again after the last.

  A worker's batches, stepped through in the order the JAX side steps through its own.
  """
  state = {"next": 0}

  def take():
    item = items[state["next"] % len(items)]
    state["next"] += 1
    return item

  return take


def serve(run_steps, info: dict) -> None:
  """Answers ``run`` requests on stdin until ``quit`` or end of input.

  Args:
    run_steps: ``run_steps(n)`` runs ``n`` training steps and returns the last
      loss as a float, after the work is finished (synchronised).
    info: sent with the ready message (setup details to print).
  """
  _send("ready", dict(info, peak_rss_mib=peak_rss_mib()))
  for line in sys.stdin:
    request = json.loads(line)
    if request["op"] == "run":
      start = time.perf_counter()
      loss = run_steps(int(request["steps"]))
      seconds = time.perf_counter() - start
      _send("result", {"seconds": seconds, "loss": float(loss)})
    elif request["op"] == "quit":
      break
  _send("done", {"peak_rss_mib": peak_rss_mib()})


class WorkerError(RuntimeError):
  pass


class Worker:
  """A worker process seen from the benchmark (see ``serve``)."""

  def __init__(self, name: str, argv: list[str], env: dict):
    self.name = name
    self.log = tempfile.NamedTemporaryFile("w+", prefix="bench_worker_", suffix=".log")
    self.proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
        env=env, text=True, bufsize=1,
    )

  def _read(self, kind: str) -> dict:
    for line in self.proc.stdout:
      if line.startswith(PREFIX + kind + " "):
        return json.loads(line[len(PREFIX + kind) + 1:])
    self.proc.wait()
    self.log.seek(0)
    tail = "".join(self.log.readlines()[-25:])
    raise WorkerError(
        f"worker {self.name!r} exited (code {self.proc.returncode}) before "
        f"sending {kind!r}; the end of its stderr:\n{tail}")

  def _write(self, request: dict) -> None:
    self.proc.stdin.write(json.dumps(request) + "\n")
    self.proc.stdin.flush()

  def ready(self) -> dict:
    return self._read("ready")

  def run(self, steps: int) -> dict:
    self._write({"op": "run", "steps": steps})
    return self._read("result")

  def close(self) -> dict:
    """Stops the worker; returns its final message (``peak_rss_mib``)."""
    try:
      self._write({"op": "quit"})
      out = self._read("done")
    finally:
      self.proc.stdin.close()
      self.proc.wait()
      self.log.close()
    return out

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()
    self.log.close()


def sample_ms(worker, steps: int) -> float:
  """One timed sample of a worker: ``steps`` of its steps back to back, ms per step.

  The worker times them itself, so the request's round trip is not in it.
  """
  return worker.run(steps)["seconds"] * 1e3 / steps


def missing_note(peer_python: str) -> str | None:
  """The note to print when the peer venv is missing, else None."""
  if os.path.exists(peer_python):
    return None
  return (f"PyTorch columns skipped: {peer_python} not found; install the peers with "
          "`bash benchmarks/install_peers.sh` (../shared/PEERS.md).")


def start_or_note(name: str, argv: list[str], env: dict, notes: list[str]):
  """Starts a worker and waits until it is ready: ``(worker, info)``.

  A worker that fails to start is killed and leaves a line in ``notes``;
  then ``(None, None)``.
  """
  worker = Worker(name, argv, env)
  try:
    return worker, worker.ready()
  except WorkerError as e:
    worker.kill()
    notes.append(f"{name}: skipped, its worker failed: {e}")
    return None, None


def default_env(**overrides) -> dict:
  env = dict(os.environ)
  env.update({k: str(v) for k, v in overrides.items()})
  return env


#: glibc's switch for transparent huge pages: large blocks advised onto 2 MiB pages.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def peer_env(**overrides) -> dict:
  """A PyTorch worker's environment: ``default_env``, its large blocks on huge pages.

  embedlib's CPU kernels move a large table onto 2 MiB pages
  (``embedlib/kernels/cpu/huge_pages.h``); glibc's ``hugetlb`` tunable gives
  the peer's tables the same pages, from their first touch, so the two
  sides compare on equal pages. Not where ``EMBEDLIB_HUGE_PAGES`` turns
  embedlib's off (0, false, off, no), nor where ``GLIBC_TUNABLES`` already
  says.
  """
  env = default_env(**overrides)
  off = env.get("EMBEDLIB_HUGE_PAGES", "").strip().lower() in ("0", "false", "off", "no")
  tunables = env.get("GLIBC_TUNABLES", "")
  if not off and "hugetlb" not in tunables:
    env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, HUGE_PAGES_TUNABLE) if t)
  return env
