"""Test and doctest setup: 8 simulated CPU devices, set before jax is imported.

Most of the suite's time is XLA:CPU compiling one small program after another
(a fresh program per parametrized case), not running them, so the tests
compile with LLVM at -O0 (``--xla_backend_optimization_level=0``): the level
XLA:CPU hands LLVM's code generator. What the tests read comes before that
step (the HLO, the lowered text, the buffer assignment that compiled memory
analysis reports: the exact-bytes tests pass unchanged at -O0), and the
results are checked against references with tolerances or against programs
compiled with the same flags.

XLA:CPU aborts the process when a simulated device reaches a collective
more than its terminate timeout after the first one (the
``xla_cpu_collective_call_*`` flags). On 2 cores shared by two test
workers and CI's other jobs, a train loop's step aborted so in a CI run (a
"Fatal Python error: Aborted" in its ``block_until_ready``, the same test
passing alone and in order with its neighbours), which is how the train
loop's collective timeouts showed before (``train_lib.one_step_in_flight``).
The tests allow 300 s: a late device waits, and a true deadlock still ends
in an abort rather than hanging the run.

Flags already in XLA_FLAGS come after it and win
(``--xla_backend_optimization_level=2`` runs the suite with XLA's default).
On jaxlib 0.10 the tests also compile with the classic CPU emitters
(``--xla_cpu_use_fusion_emitters=false``, ``tests/xla_env.py``). They
recompute a fused element per use, which once made a deep chain of
elementwise ops with reversed reads compile for minutes; no test's program
does so now, and they compile the suite's small programs for less. There
each program's LLVM module is also compiled in one piece
(``--xla_cpu_parallel_codegen_split_count=1``).
"""

import gc
import os

from tests import xla_env  # plain Python: jax is not imported yet

os.environ["XLA_FLAGS"] = " ".join(
    list(xla_env.SUITE_FLAGS)
    + os.environ.get("XLA_FLAGS", "").split()
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_runtest_setup(item):
  """A SIGTERM that ends a test worker prints every thread's stack first.

  A worker that dies without a Python error leaves pytest-xdist only "node
  down: Not properly terminated"; fatal signals already print their stacks
  (pytest's faulthandler), SIGTERM does not. Registered before each test
  because a test that installs its own SIGTERM handler (``StopSignals``)
  puts back Python's view of the old one, which drops this.
  """
  del item
  import faulthandler
  import signal
  faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)


import pytest  # noqa: E402

# Python's cyclic collector, at its default thresholds, ran a full collection
# over every object of a test worker (jax's caches of traced and compiled
# programs among them) every few thousand allocations that tracing makes:
# about a tenth of the CPU time of the two files timed so (test_contract,
# quant/test_layouts). Rarer collections, and none over
# what the imports made (frozen once the tests are collected), free the same
# garbage later.
gc.set_threshold(7000, 20, 100)


def pytest_collection_finish(session):
  del session
  gc.freeze()


def pytest_collection_modifyitems(items):
  """``tests/train``'s files first, each file's tests in their order.

  They hold the suite's longest files (whole training runs, 10 to 60 s a
  test). pytest-xdist hands out whole files in collection order, where they
  came last: a worker could finish its share while the other still ran one,
  idle for up to a minute. First, the tail is the suite's many short files.
  """
  items.sort(key=lambda item: not item.nodeid.startswith("tests/train/"))


@pytest.fixture
def auto_runs_pallas_on_gpu(monkeypatch):
  """``kernel="auto"`` with the Pallas kernels where `gpu_choice` has no measured choice, on CUDA.

  For tests of the kernels inside programs that ``auto`` builds (a layout's
  collectives, an exported step), now that every unmeasured shape runs XLA's
  ops on a GPU (`gpu_choice.FALLBACK`).
  """
  from embedlib.kernels import gpu_choice
  monkeypatch.setattr(gpu_choice, "FALLBACK", "pallas")
