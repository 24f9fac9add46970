"""``python -m train.predict --model DIR --data FILE --out OUT``: score a file with an artifact.

Streams a Criteo TSV file (plain or ``.gz``; lines with or without the
label field) through an artifact of ``python -m train.export`` in batches of
``--batch_size`` lines, with bounded memory and progress on stderr, and
writes one click probability per input line, in input order, one float a
line (``%.9g``: the float32 exactly). The categorical values are hashed as
the run's reader hashed them (``embedlib.data.CriteoReader``). A malformed
line stops the run naming its line number; an expected failure prints one
line and exits 1.
"""

import logging
import os
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", None, "An artifact directory of python -m train.export.")
_DATA = flags.DEFINE_string("data", None, "The file to score (Criteo TSV, plain or .gz).")
_OUT = flags.DEFINE_string("out", None, "Where to write the scores (text, one a line).")
_BATCH = flags.DEFINE_integer("batch_size", 4096, "Lines scored per call.")
_EVERY = flags.DEFINE_integer("log_every", 100_000, "Log progress every this many lines.")
flags.mark_flags_as_required(["model", "data", "out"])

log = logging.getLogger("embedlib.predict")


class PredictError(ValueError):
  """An artifact or a data file that can't be scored; the message names it and the fix."""


def _criteo_reader(manifest: dict, path: str):
  from embedlib import data  # pylint: disable=g-import-not-at-top  (after the CLI parses)

  info = manifest.get("data", {})
  if manifest["task"] != "ctr" or info.get("source") != "criteo":
    raise PredictError(
        f"{_MODEL.value} is a {manifest['task']} artifact of a {info.get('source')!r} run; "
        "train.predict scores Criteo files with artifacts of ctr runs on the criteo source "
        "(configs/dlrm_criteo.py). Call embedlib.serving.load for other inputs.")
  sizes = [f["num_embeddings"] for f in info["features"]]
  return data.CriteoReader(path, data.criteo_spec(sizes), batch_size=1)


def _lines(path: str):
  """``(line number, parsed)`` of each line; a line without the label reads as label 0."""
  import gzip  # pylint: disable=g-import-not-at-top

  from embedlib.data import criteo  # pylint: disable=g-import-not-at-top

  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      try:
        text = raw.decode("ascii")
        if text.count("\t") == criteo.CRITEO_NUM_DENSE + criteo.CRITEO_NUM_SPARSE - 1:
          text = "0\t" + text  # the Criteo test files carry no label
        yield criteo.parse_line(text)
      except (ValueError, UnicodeDecodeError) as e:
        reason = "not ASCII text" if isinstance(e, UnicodeDecodeError) else str(e)
        raise PredictError(f"{path}:{number}: {reason}. Fix or remove the line: every line "
                           "gets a score, in order.") from None


def predict(model, reader, path: str, out, batch_size: int, log_every: int) -> int:
  """Scores every line of ``path`` into ``out``; returns the number of lines."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  done, start, rows = 0, time.perf_counter(), []

  def flush():
    batch = reader.assemble(rows)
    scores = model({"dense": batch["dense"], **batch["sparse"]})["probability"]
    out.write("".join(f"{p:.9g}\n" for p in np.asarray(scores, np.float32).tolist()))
    rows.clear()

  for parsed in _lines(path):
    rows.append(parsed)
    if len(rows) == batch_size:
      flush()
      done += batch_size
      if done % log_every < batch_size:
        log.info("%d lines, %.0f lines/s", done, done / (time.perf_counter() - start))
  if rows:
    done += len(rows)
    flush()
  return done


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}.")
  from embedlib import serving  # pylint: disable=g-import-not-at-top
  from embedlib.data import criteo  # pylint: disable=g-import-not-at-top

  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top

  absl_logging.set_verbosity(absl_logging.WARNING)  # jax's start-up notes
  handler = logging.StreamHandler()
  handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  log.propagate = False
  if _BATCH.value < 1:
    sys.exit(f"error: --batch_size={_BATCH.value}; pass a positive number of lines.")
  partial = _OUT.value + ".partial"
  try:
    model = serving.load(_MODEL.value)
    reader = _criteo_reader(model.manifest, _DATA.value)
    with open(partial, "w", encoding="ascii") as out:
      count = predict(model, reader, _DATA.value, out, _BATCH.value, _EVERY.value)
    os.replace(partial, _OUT.value)
  except (PredictError, serving.ArtifactError, serving.PlatformError, criteo.CriteoFormatError,
          OSError) as e:
    if os.path.exists(partial):
      os.remove(partial)
    sys.exit(f"error: {e}")
  log.info("wrote %d scores to %s", count, _OUT.value)


if __name__ == "__main__":
  app.run(main)
