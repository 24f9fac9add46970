"""``python -m train --config configs/quickstart.py --workdir runs/quickstart``.

Run from a checkout (``configs/`` and ``train/`` are not installed). Flags,
then one call into ``embedlib.training.train_and_evaluate``. Multi-host:
pass ``--coordinator_address``, ``--num_processes`` and ``--process_id`` (or
``--distributed`` to let ``jax.distributed.initialize()`` detect SLURM and
the like); each process then reads its own slice of the data. An expected
failure (a bad config or data file, a failed save) prints one line and
exits 1; SIGTERM or SIGINT saves a checkpoint and exits 0. A program that
makes no progress (``--stuck_after`` seconds, or a collective XLA reports
stuck) prints which, and the step, and exits 3; SIGTERM or SIGINT during
such a wait exits at once, saying so (128 + the signal). Either leaves the
checkpoints as they are (``embedlib.training.watchdog``).
"""

import gc
import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A configs/*.py file, optionally :variant.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 8, "Simulated devices when running on CPU (0: leave XLA_FLAGS alone).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Also show jax's and orbax's logs and tracebacks.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() with auto-detection.")
_STUCK_AFTER = flags.DEFINE_float(
    "stuck_after", 600.0, "Seconds a step, eval or save may go without progress before the "
    "run ends with exit status 3 (its first call, which compiles, aside); 0: no limit.")
flags.mark_flags_as_required(["config", "workdir"])


def _config_file(argv) -> str:
  """The --config file named in ``argv`` (without its :variant), for messages."""
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1].split(":")[0]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1].split(":")[0]
  return "the --config file"


def _parse_flags(argv):
  """absl's parsing, with a config error (a misspelt key, a bad variant) as one line."""
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-exception-caught
    chain = [e]
    while (chain[-1].__cause__ or chain[-1].__context__) is not None:
      chain.append(chain[-1].__cause__ or chain[-1].__context__)
    texts = [x.args[0] for x in chain if x.args and isinstance(x.args[0], str)] or [str(e)]
    missing = next((x for x in chain if isinstance(x, KeyError)), None)
    if missing is not None and missing.args and isinstance(missing.args[0], str):
      # ConfigDict's KeyError: "'key'\nDid you mean ...?" when a key is near, else "key".
      key, _, hint = missing.args[0].partition("\n")
      key = key.strip("'")
      flag = next((a.split("=")[0] for a in argv if a.startswith("--config.") and
                   a.split("=")[0].rsplit(".", 1)[-1] == key), "--config")
      hint = hint or (f"No key is near it: see {_config_file(argv)} for the keys, or "
                      "drop the override.")
      text = f"{flag}: the config has no key {key!r}. {hint}"
    else:
      text = next((t for t in texts if "Traceback" not in t), texts[-1])
    sys.exit("FATAL Flags parsing error: " + " ".join(text.split()))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; settings go in --config.KEY=VALUE.")
  try:
    config = _CONFIG.value
    config.get("seed")  # config_flags defers a load failure to the first access
  except OSError:
    sys.exit(f"FATAL Flags parsing error: --config={flags.FLAGS['config'].config_filename.split(':')[0]}: "
             "no such file. Pass a configs/*.py file, from the root of a checkout "
             "(configs/ is not installed).")
  if _CPU_DEVICES.value and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_CPU_DEVICES.value}")
  from embedlib import cpu_pool  # pylint: disable=g-import-not-at-top  (no jax yet)

  cpu_pool.configure()  # before the backend starts, which sizes its pool once
  import jax  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS)

  from embedlib import training  # pylint: disable=g-import-not-at-top
  from embedlib.training import console  # pylint: disable=g-import-not-at-top

  # Tracing and compiling the run's programs makes millions of short-lived
  # objects; at Python's default thresholds the cyclic collector walked all
  # that the imports made (jax, flax, orbax) hundreds of times meanwhile.
  # Those stay for the run: frozen, no collection walks them; rarer
  # collections free the same garbage.
  gc.freeze()
  gc.set_threshold(7000, 20, 100)
  log = console.setup_logging(_VERBOSE.value)
  if _COORDINATOR.value or _DISTRIBUTED.value:
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  log.info("jax %s, %d processes, %d devices", jax.__version__, jax.process_count(),
           jax.device_count())
  if jax.default_backend() == "cpu":
    small = cpu_pool.check(jax.local_device_count())
    if small:
      log.warning("%s", small)
  try:
    result = training.train_and_evaluate(config, _WORKDIR.value, stuck_after=_STUCK_AFTER.value)
  except console.EXPECTED_ERRORS as e:
    if _VERBOSE.value:
      log.exception("traceback:")
    log.error("error: %s", e)
    sys.exit(1)
  except KeyboardInterrupt as e:
    log.error("stopped at once (%s); rerun to resume from the newest checkpoint in %s.",
              e or "interrupted", os.path.join(_WORKDIR.value, "checkpoints"))
    sys.exit(130)
  log.info("%s", _last_eval_line(result, config.num_train_steps))


def _last_eval_line(result: dict, num_train_steps: int) -> str:
  """The run's last eval, labelled with its step; not "final" when the run stopped early."""
  if not result:
    return "no eval ran."
  metrics = "  ".join(f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}"
                     for k, v in result.items() if k != "step")
  if result["step"] >= num_train_steps:
    return f"final eval, at step {result['step']}: {metrics}"
  return (f"the run stopped before num_train_steps={num_train_steps}; its last eval, at "
          f"step {result['step']}: {metrics}")


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
