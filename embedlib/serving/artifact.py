"""The serving artifact on disk: a manifest, a program and its weights.

A directory holds::

    manifest.json      what the program takes and returns, the weights' names,
                       dtypes and shapes, and the sha256 of every other file
    program-P.jax      the scoring function, ``jax.export`` serialized for
                       platform P (one file per platform: cpu, cuda, ...)
    weights/NNNN.npy   one array per weight, plain ``.npy`` (no pickled objects)

Reading executes nothing from the files: the manifest is JSON, the weights
are ``.npy`` read with ``allow_pickle=False`` after their hash is checked, and
the program is StableHLO that XLA compiles. Every check here raises
``ArtifactError`` naming the file, what is wrong with it and the fix.
This module imports numpy and the standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import ml_dtypes

#: The manifest's ``format`` key; a reader refuses others.
FORMAT = "embedlib.serving/1"
MANIFEST = "manifest.json"
WEIGHTS_DIR = "weights"
_CHUNK = 1 << 22


class ArtifactError(ValueError):
  """An artifact file that is missing, corrupt or tampered with; the message names it and the fix."""


def sha256(path: str) -> str:
  """The hex sha256 of the file at ``path``, read in chunks (bounded memory)."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(_CHUNK), b""):
      digest.update(block)
  return digest.hexdigest()


def program_file(platform: str) -> str:
  """The artifact-relative path of the program lowered for ``platform``."""
  return f"program-{platform}.jax"


def weight_file(index: int) -> str:
  """The artifact-relative path of weight ``index``."""
  return f"{WEIGHTS_DIR}/{index:04d}.npy"


#: Dtypes ``.npy`` can't name (``ml_dtypes``, which jax brings): stored as their bits.
BIT_VIEWS = {name: np.dtype(getattr(ml_dtypes, name))
             for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")}


def write_weight(directory: str, index: int, array) -> dict:
  """Writes weight ``index`` as ``.npy``; returns its manifest entry (without its name).

  A jax array is written shard by shard into the file (memory-mapped), so a
  table split over devices is never gathered whole on the host.
  """
  shards = getattr(array, "addressable_shards", None)
  dtype, shape = np.dtype(array.dtype), tuple(array.shape)
  if dtype.hasobject:
    raise ValueError(f"weight {index} has dtype {dtype}; only numeric arrays serve.")
  entry = {}
  if dtype.name in BIT_VIEWS:  # .npy has no bfloat16 / float8: their bits, read back as a view
    entry["view"], dtype = dtype.name, np.dtype(f"<u{dtype.itemsize}")
    to_host = lambda x: np.asarray(x).view(dtype)
  else:
    to_host = np.asarray
  relative = weight_file(index)
  os.makedirs(os.path.join(directory, WEIGHTS_DIR), exist_ok=True)
  path = os.path.join(directory, relative)
  if shards is None or not shape or 0 in shape:
    np.save(path, to_host(array), allow_pickle=False)
  else:
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    for shard in shards:
      if shard.replica_id == 0:  # each block once, however many devices hold it
        out[shard.index] = to_host(shard.data)
    out.flush()
    del out
  return {"file": relative, "dtype": dtype.str, "shape": list(shape), **entry}


def finish(directory: str, manifest: dict) -> None:
  """Hashes every file the manifest names and writes ``manifest.json`` last."""
  files = list(manifest["programs"].values()) + [w["file"] for w in manifest["weights"]]
  manifest = dict(manifest, format=FORMAT,
                  files={f: sha256(os.path.join(directory, f)) for f in files})
  with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
    f.write("\n")


def _fix(directory: str) -> str:
  return (f"export the model again (python -m train.export --workdir W --out {directory}) "
          "or copy the artifact again from where it was exported")


def _path(directory: str, relative: str) -> str:
  """``relative`` under ``directory``; a name that leaves the directory is refused."""
  if not isinstance(relative, str) or os.path.isabs(relative) or ".." in relative.split("/"):
    raise ArtifactError(f"{os.path.join(directory, MANIFEST)} names the file {relative!r}, "
                        f"which is not inside the artifact; the manifest was altered: "
                        f"{_fix(directory)}.")
  return os.path.join(directory, relative)


def read_manifest(directory: str) -> dict:
  """The manifest of the artifact in ``directory``, its format and fields checked."""
  path = os.path.join(directory, MANIFEST)
  if not os.path.isdir(directory):
    raise ArtifactError(f"{directory} is not a directory; pass the --out directory of "
                        "python -m train.export.")
  if not os.path.isfile(path):
    raise ArtifactError(f"{path} is missing, so {directory} is no serving artifact (or its "
                        f"export did not finish); {_fix(directory)}.")
  try:
    with open(path, encoding="utf-8") as f:
      manifest = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise ArtifactError(f"{path} is not valid JSON ({e}); {_fix(directory)}.") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    raise ArtifactError(f"{path} has format {found!r}, not {FORMAT!r}; {_fix(directory)} "
                        "with this embedlib.")
  for key in ("task", "inputs", "outputs", "weights", "files", "batch_size", "programs"):
    if key not in manifest:
      raise ArtifactError(f"{path} lacks the key {key!r}; {_fix(directory)}.")
  named = set(manifest["programs"].values()) | {w.get("file") for w in manifest["weights"]}
  if set(manifest["files"]) != named:
    raise ArtifactError(f"{path}: its 'files' hashes {sorted(manifest['files'])} but the "
                        f"artifact needs {sorted(named)}; the manifest was altered: "
                        f"{_fix(directory)}.")
  return manifest


def check_file(directory: str, manifest: dict, relative: str) -> str:
  """The path of ``relative``, after checking it exists and has the manifest's sha256."""
  path = _path(directory, relative)
  if not os.path.isfile(path):
    raise ArtifactError(f"{path} is missing from the artifact; {_fix(directory)}.")
  found = sha256(path)
  if found != manifest["files"][relative]:
    raise ArtifactError(f"{path} has sha256 {found[:16]}..., not the manifest's "
                        f"{manifest['files'][relative][:16]}...: the file is corrupt or was "
                        f"changed; {_fix(directory)}.")
  return path


def read_program(directory: str, manifest: dict, platform: str) -> bytes:
  with open(check_file(directory, manifest, manifest["programs"][platform]), "rb") as f:
    return f.read()


def read_weight(directory: str, manifest: dict, entry: dict) -> np.ndarray:
  """One weight, memory-mapped, its hash, dtype and shape checked against the manifest."""
  path = check_file(directory, manifest, entry["file"])
  try:
    array = np.load(path, mmap_mode="r", allow_pickle=False)
  except ValueError as e:  # a pickled object array, or not .npy at all
    raise ArtifactError(f"{path} is not a plain .npy array ({e}); {_fix(directory)}.") from None
  if array.dtype.str != entry["dtype"] or list(array.shape) != list(entry["shape"]):
    raise ArtifactError(
        f"{path} holds {array.dtype.str} {list(array.shape)}, the manifest says weight "
        f"{entry.get('name')!r} is {entry['dtype']} {list(entry['shape'])}; "
        f"{_fix(directory)}.")
  if "view" in entry:
    if entry["view"] not in BIT_VIEWS:
      raise ArtifactError(f"{path}: the manifest's view {entry['view']!r} is none of "
                          f"{sorted(BIT_VIEWS)}; {_fix(directory)}.")
    array = array.view(BIT_VIEWS[entry["view"]])
  return array
