"""``python -m train --config configs/quickstart.py --workdir runs/quickstart``.

Run from a checkout (``configs/`` and ``train/`` are not installed). Flags,
then one call into ``embedlib.training.train_and_evaluate``. Multi-host:
pass ``--coordinator_address``, ``--num_processes`` and ``--process_id`` (or
``--distributed`` to let ``jax.distributed.initialize()`` detect SLURM and
the like); each process then reads its own slice of the data.
"""

import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A configs/*.py file, optionally :variant.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 8, "Simulated devices when running on CPU (0: leave XLA_FLAGS alone).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Also show INFO logs of jax and orbax.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() with auto-detection.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; settings go in --config.KEY=VALUE.")
  if _CPU_DEVICES.value and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_CPU_DEVICES.value}")
  if not _VERBOSE.value:
    logging.set_verbosity(logging.WARNING)
  handler = std_logging.StreamHandler(sys.stderr)
  handler.setFormatter(std_logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
  train_log = std_logging.getLogger("embedlib.train")
  train_log.addHandler(handler)
  train_log.setLevel(std_logging.INFO)
  train_log.propagate = False
  import jax  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS)

  if _COORDINATOR.value or _DISTRIBUTED.value:
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  from embedlib.training import train_and_evaluate  # pylint: disable=g-import-not-at-top

  train_log.info("jax %s, %d processes, %d devices", jax.__version__, jax.process_count(),
                 jax.device_count())
  result = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  train_log.info("final eval: %s", result)


if __name__ == "__main__":
  app.run(main)
