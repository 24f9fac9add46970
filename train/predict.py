"""``python -m train.predict --model DIR --data FILE --out OUT``: score a file with an artifact.

- A ``ctr`` artifact of a Criteo run: streams a Criteo TSV file (plain or
  ``.gz``; lines with or without the label field) in batches of
  ``--batch_size`` lines, with bounded memory and progress on stderr, and
  writes one click probability per input line, in input order, one float a
  line (``%.9g``: the float32 exactly). The categorical values are hashed
  as the run's reader hashed them (``embedlib.data.CriteoReader``), or, for
  a run with raw ids (dynamic tables), read as they are and looked up in
  the artifact's id -> row maps. A malformed line stops the run naming its
  line number.
- A ``tabular`` artifact (a run of configs/tabular.py): reads the same kinds
  of files its run did (Parquet files, directories and globs, CSV / TSV with
  a header, RecBole atomic files), by the run's schema, the label columns
  optional, and writes one line per input row, in input order: the click
  probability (several labels: one per label, tab-separated), or the two
  towers' score. String ids are hashed as in training.
- A ``sequential`` artifact (SASRec, HSTU): reads a MovieLens release or
  RecBole files (``embedlib.data.movielens``) and writes, per user, the
  file's user id, a tab, and the top k next items (the file's item ids,
  best first, space-separated), from each user's last ``max_len`` items.
  Items the artifact's run never saw are read as padding. An artifact of a
  run on raw ids reads the file's ids as they are and returns the raw ids
  of the movies resident in its item table.

An artifact sharded over N devices runs on N CPU devices where jax runs on
CPU (``--xla_force_host_platform_device_count=N`` is set for it). An
expected failure prints one line and exits 1.
"""

import logging
import os
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", None, "An artifact directory of python -m train.export.")
_DATA = flags.DEFINE_string("data", None, "The file to score: Criteo TSV (plain or .gz), "
                            "MovieLens, or a tabular run's kind of files.")
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
        "(configs/dlrm_criteo.py) and MovieLens files with sequential artifacts (SASRec, "
        "HSTU). Call embedlib.serving.load for other inputs.")
  sizes = [f["num_embeddings"] for f in info["features"]]
  return data.CriteoReader(path, data.criteo_spec(sizes), batch_size=1,
                           raw_ids=bool(info.get("raw_ids", False)))


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


def predict_next_items(model, path: str, out, batch_size: int) -> int:
  """Writes each user's top k next items of the MovieLens data at ``path``; returns the users."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from embedlib.data import movielens  # pylint: disable=g-import-not-at-top
  from embedlib.data.movielens_requests import raw_ids_of  # pylint: disable=g-import-not-at-top

  info = model.manifest["data"]
  max_len = info["max_len"]
  interactions = movielens.load(path)
  if info.get("raw_ids"):  # the run's tables read the file's ids; its items come back as such
    to_artifact = np.concatenate([[-1], raw_ids_of(interactions.raw_item_ids[1:], "movie")])
    from_artifact, pad = None, -1
  else:  # the file's dense ids to the artifact's (-1: an item the run never saw), and back
    known = {raw: dense for dense, raw in enumerate(info["raw_item_ids"]) if dense > 0}
    to_artifact = np.array([known.get(r, -1) for r in interactions.raw_item_ids.tolist()],
                           np.int64)
    from_artifact, pad = np.asarray(info["raw_item_ids"], dtype=object), 0
  starts = np.searchsorted(interactions.user, np.arange(interactions.num_users + 1))
  users = 0
  for first in range(0, interactions.num_users, batch_size):
    rows = range(first, min(first + batch_size, interactions.num_users))
    items = np.full((len(rows), max_len), pad, np.int64)
    times = np.zeros((len(rows), max_len), np.int64)
    filled = np.zeros((len(rows), max_len), bool)
    for r, u in enumerate(rows):
      lo = max(starts[u], starts[u + 1] - max_len)
      n = starts[u + 1] - lo
      items[r, max_len - n:] = to_artifact[interactions.item[lo:starts[u + 1]]]
      times[r, max_len - n:] = interactions.time[lo:starts[u + 1]]
      filled[r, max_len - n:] = True
    inputs = {"items": items}
    if "times" in model.input_names:  # HSTU: seconds from the row's first item; the
      base = np.where(filled, times, np.iinfo(np.int64).max).min(axis=1, keepdims=True)
      times = np.where(filled, times - base, 0)
      # position i is asked about the time of item i + 1; the last, about its own.
      inputs["times"] = times
      inputs["query_times"] = np.concatenate([times[:, 1:], times[:, -1:]], axis=1)
    top = model(inputs)["items"]
    for u, best in zip(rows, top):
      best = best[best >= 0] if from_artifact is None else from_artifact[best]
      out.write(f"{interactions.raw_user_ids[u]}\t{' '.join(str(x) for x in best)}\n")
    users += len(rows)
    log.info("%d of %d users", users, interactions.num_users)
  return users


def predict_rows(model, path: str, out, log_every: int) -> int:
  """Writes one line per row of a tabular run's files (module docstring); returns the rows."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from embedlib.serving import tabular as served_tabular  # pylint: disable=g-import-not-at-top

  done, start = 0, time.perf_counter()
  for outputs in served_tabular.score_file(model, path):
    values = np.asarray(next(iter(outputs.values())), np.float32)
    values = values.reshape(len(values), -1)
    out.write("".join("\t".join(f"{v:.9g}" for v in row) + "\n" for row in values.tolist()))
    before, done = done, done + len(values)
    if done // log_every > before // log_every:
      log.info("%d rows, %.0f rows/s", done, done / (time.perf_counter() - start))
  return done


def _devices_wanted(directory: str) -> int:
  """The artifact's device count, read before jax starts (0: unreadable; load says why)."""
  import json  # pylint: disable=g-import-not-at-top

  try:
    with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as f:
      return int(json.load(f).get("devices", 1))
  except (OSError, ValueError, TypeError, AttributeError):
    return 0


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}.")
  devices = _devices_wanted(_MODEL.value)
  if devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):  # a sharded artifact on a CPU machine: as many CPU devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}")
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
    if model.task == "sequential":
      with open(partial, "w", encoding="utf-8") as out:
        count = predict_next_items(model, _DATA.value, out, _BATCH.value)
    elif model.task == "tabular":
      with open(partial, "w", encoding="ascii") as out:
        count = predict_rows(model, _DATA.value, out, _EVERY.value)
    else:
      reader = _criteo_reader(model.manifest, _DATA.value)
      with open(partial, "w", encoding="ascii") as out:
        count = predict(model, reader, _DATA.value, out, _BATCH.value, _EVERY.value)
    os.replace(partial, _OUT.value)
  except (PredictError, serving.ArtifactError, serving.PlatformError, criteo.CriteoFormatError,
          OSError, ValueError) as e:  # the tabular readers' DataError and SchemaError too
    if os.path.exists(partial):
      os.remove(partial)
    sys.exit(f"error: {e}")
  log.info("wrote %d %s to %s", count, "users' top items" if model.task == "sequential"
           else "scores", _OUT.value)


if __name__ == "__main__":
  app.run(main)
