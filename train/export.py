"""``python -m train.export --workdir W --out DIR``: a finished run as a serving artifact.

Reads the run's config (``W/config.json``) and last checkpoint, and writes
``DIR``: the task's scoring function serialized with ``jax.export`` (one
program per ``--platforms`` entry), its weights as ``.npy`` files and a
manifest of its inputs and outputs with the sha256 of every file. Load it
with ``embedlib.serving.load(DIR)`` (jax and numpy only), or score a file
with ``python -m train.predict``. A run on raw ids (dynamic tables) carries
each table's id -> row map and scores raw ids in eval mode (a resident id
reads its row, any other the table's default). An expected failure prints
one line and exits 1.
"""

import os
import sys

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", None, "The workdir of a finished python -m train run.")
_OUT = flags.DEFINE_string("out", None, "The artifact's directory (new, or empty).")
_BITS = flags.DEFINE_enum("bits", None, ["8", "4", "fp8", "bf16"],
                          "Quantize the tables first: 8 or 4 bits a value with a scale and bias "
                          "per row, fp8 (e4m3) or bf16 (embedlib.quantize).")
_PLATFORMS = flags.DEFINE_list("platforms", ["cpu"], "Lowering platforms: cpu, cuda, rocm, tpu.")
_DEVICES = flags.DEFINE_integer(
    "devices", 1, "Devices the program is sharded over (the run's mesh axes); 1 serves on one "
    "device.")
_BATCH = flags.DEFINE_integer("batch_size", None, "The program's batch (default: the run's).")
_TOP_K = flags.DEFINE_integer("top_k", 100, "Retrieval, next-item: items returned per row.")
_EXCLUDE = flags.DEFINE_bool("exclude_input", False,
                             "Next-item: leave a history's own items out of its top k.")
flags.mark_flags_as_required(["workdir", "out"])


def _bits(value):
  return int(value) if value in ("8", "4") else value


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}.")
  if _DEVICES.value > 1 and "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_DEVICES.value}")
  from embedlib.training import console  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS)
  from embedlib.training import export_lib  # pylint: disable=g-import-not-at-top

  log = console.setup_logging(False)
  try:
    export_lib.check_out(_OUT.value)  # before the minutes a large model takes to restore
    config, model, mesh = export_lib.restore(_WORKDIR.value, _DEVICES.value)
    manifest = export_lib.export(
        config, model, mesh, _OUT.value, batch_size=_BATCH.value,
        platforms=tuple(_PLATFORMS.value), bits=_bits(_BITS.value),
        top_k=_TOP_K.value, exclude_input=_EXCLUDE.value, workdir=_WORKDIR.value)
  except (export_lib.ExportError, NotImplementedError, *console.EXPECTED_ERRORS) as e:
    log.error("error: %s", e)
    sys.exit(1)
  log.info("wrote %s: task %s, %d inputs, %d weights, programs for %s on %d device(s).",
           _OUT.value, manifest["task"], len(manifest["inputs"]), len(manifest["weights"]),
           ", ".join(manifest["programs"]), manifest["devices"])


if __name__ == "__main__":
  app.run(main)
