"""The suite's XLA flags, for this process (``conftest.py``) and the test subprocesses.

A subprocess gets them with its own device count, so what it compiles
compiles as the tests' own programs do (LLVM at -O0; see ``conftest.py``)
rather than at XLA's default, which costs a subprocess's compiles several
times as much.
"""

import importlib.metadata
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SUITE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60",
    "--xla_cpu_collective_call_terminate_timeout_seconds=300",
) + (
    # The classic (pre-MLIR) CPU emitters compile the suite's many small
    # programs for less. jaxlib 0.11+ has only the new ones and
    # rejects the flag, so there it is left out. With them, each program's
    # LLVM module is also compiled in one piece: split for the compile
    # threads (XLA's default), the suite's small programs took about a
    # tenth more CPU time; on jaxlib 0.12 one piece gained nothing.
    ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
    if importlib.metadata.version("jaxlib").split(".")[:2] == ["0", "10"] else ()
)


def flags(devices: int) -> str:
  """``XLA_FLAGS`` for ``devices`` simulated CPU devices."""
  return " ".join([*SUITE_FLAGS, f"--xla_force_host_platform_device_count={devices}"])


def subprocess_env(devices: int = 8) -> dict:
  """This environment with the suite's flags for ``devices`` CPU devices and the checkout on the path."""
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=flags(devices))
  # This process's pool size is for its own device count: the child's
  # ``import embedlib`` sizes its own (embedlib.cpu_pool).
  env.pop("PJRT_NPROC", None)
  return env


def default_subprocess_env(devices: int = 8) -> dict:
  """``subprocess_env`` compiling at XLA's own settings, not the suite's.

  For a test that asserts two different programs (a pipelined and an
  in-line step) give the same bits: at the suite's LLVM -O0 with jaxlib
  0.10's classic emitters, the same arithmetic in two programs may round
  differently, which is not what a user's compile does.
  """
  env = subprocess_env(devices)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return env
