"""What a training process prints: embedlib's progress lines, and one line per expected failure.

Used by the ``python -m train`` entrypoint, which owns the process. A
library caller (a notebook) keeps its own logging and gets the exceptions.
"""

from __future__ import annotations

import logging
import sys

from absl import logging as absl_logging

from embedlib import checkpoint, data
from embedlib.training import setup, writers

#: Failures the trainer explains in its message; the entrypoint prints that one
#: line (no traceback) and exits 1. Anything else is a bug and keeps its traceback.
EXPECTED_ERRORS = (
    setup.ConfigError,
    setup.WorkdirError,
    data.CriteoFormatError,
    data.BadBatchError,
    checkpoint.CheckpointSaveError,
    checkpoint.CheckpointMismatchError,
    checkpoint.CheckpointRestoreError,
    writers.MetricWriteError,
    FileNotFoundError,
    IsADirectoryError,
)


def _drop_closed_loop_noise(hook):
  """``sys.unraisablehook`` without the tracebacks a failed orbax restore leaves behind.

  When one read of a corrupt checkpoint fails, tensorstore completes the
  other pending reads after orbax's event loop has closed, and each reports
  "Event loop is closed"; the checkpointer's warning says what failed.
  """
  def filtered(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and
            "Event loop is closed" in str(unraisable.exc_value)):
      hook(unraisable)
  return filtered


def setup_logging(verbose: bool) -> logging.Logger:
  """Sends embedlib's logs to stderr with a time stamp; quiets jax and orbax unless ``verbose``.

  Returns:
    The trainer's logger.
  """
  if not verbose:
    absl_logging.set_verbosity(absl_logging.WARNING)
    # orbax reports a failed save or restore with tracebacks through absl;
    # embedlib's own one-line message says what happened and what to do.
    absl_logging.get_absl_handler().addFilter(lambda r: "/orbax/" not in r.pathname)
    # ...and, when it exits after a failed save, asyncio reports each of its
    # pending writes ("Future exception was never retrieved"); only orbax
    # runs asyncio in this process.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    sys.unraisablehook = _drop_closed_loop_noise(sys.unraisablehook)
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
  ours = logging.getLogger("embedlib")
  ours.addHandler(handler)
  ours.setLevel(logging.INFO)
  ours.propagate = False
  return logging.getLogger("embedlib.train")
