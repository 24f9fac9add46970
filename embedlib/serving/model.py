"""``ServedModel``: an exported scoring function with its weights, called on named inputs.

Needs jax and numpy only (and ``embedlib.invalid_ids``, the library's one
rule for out-of-range ids, which imports nothing else of embedlib): no
flax, no model code, no configs.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax import export

from embedlib import invalid_ids
from embedlib.serving import artifact
from embedlib.serving import raw_ids

#: Manifest input kinds: values passed as they are (floats, or integers such as
#: times), ids looked up in a table, and raw ids looked up in a dynamic table's
#: map (the program takes them as uint32 words, ``raw_ids``).
DENSE, IDS, RAW_IDS = "dense", "ids", "raw_ids"
_JAX_PLATFORM = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}


class InputError(ValueError):
  """Inputs the artifact can't score; the message names the input and the fix."""


class PlatformError(RuntimeError):
  """The artifact was exported for platforms (or a device count) this machine lacks."""


def platform(directory: str, manifest: dict) -> str:
  """The artifact's program platform this machine's jax runs, or PlatformError."""
  backend = jax.default_backend()
  usable = [p for p in _JAX_PLATFORM.get(backend, (backend,)) if p in manifest["programs"]]
  if not usable:
    here = _JAX_PLATFORM.get(backend, (backend,))[0]
    exported = list(manifest["programs"])
    raise PlatformError(
        f"{directory} was exported for {', '.join(exported)}; this machine runs jax on "
        f"{backend}. Export it again naming {here} too (python -m train.export ... "
        f"--platforms {','.join(exported + [here])}), or load it on such a machine.")
  return usable[0]


def _mesh(directory: str, manifest: dict, exported):
  """The mesh the program was exported on, rebuilt on this machine's first devices."""
  n = exported.nr_devices
  if n > jax.device_count():
    raise PlatformError(
        f"{directory} was exported sharded over {n} devices; this machine has "
        f"{jax.device_count()} {jax.default_backend()} device(s). Load it where {n} are "
        f"visible (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax "
        "is imported), or export it again with --devices 1.")
  mesh = manifest.get("mesh") or {"shape": [1], "axis_names": ["data"]}
  if int(np.prod(mesh["shape"])) != n:
    raise artifact.ArtifactError(
        f"{directory}/{artifact.MANIFEST}: its mesh {mesh['shape']} does not hold the "
        f"program's {n} devices; the manifest was altered: export the model again.")
  return jax.make_mesh(tuple(mesh["shape"]), tuple(mesh["axis_names"]),
                       axis_types=(jax.sharding.AxisType.Auto,) * len(mesh["shape"]),
                       devices=jax.devices()[:n])


class ServedModel:
  """A loaded artifact: ``model(inputs) -> outputs``.

  Args of ``__call__``: a mapping from each of ``input_names`` to an array
  (numpy or jax) whose first dimension is the batch, any size; the rest of
  its shape is ``manifest["inputs"][i]["shape"]``. Float inputs take any
  float dtype (cast to the manifest's), integer inputs (ids, times) any
  integer dtype: ids
  outside ``[0, num_embeddings)`` follow the library's rule (looked up as
  a zero vector, like the padding id ``-1``). Raw ids (kind ``raw_ids``,
  a run with dynamic tables) take any integer dtype too, 64-bit values
  exactly: a resident id reads its row, any other its table's default
  (zeros, or the learned shared row); ``-1`` / ``2**64 - 1`` is padding.

  Returns of ``__call__``: a dict of numpy arrays, one per
  ``output_names``, each with the batch as its first dimension.
  """

  def __init__(self, directory: str, manifest: dict, exported, weights: list):
    self.directory, self.manifest, self.exported = directory, manifest, exported
    self.batch_size = int(manifest["batch_size"])
    self.inputs = {spec["name"]: spec for spec in manifest["inputs"]}
    self.input_names = tuple(self.inputs)
    self.output_names = tuple(o["name"] for o in manifest["outputs"])
    self.mesh = _mesh(directory, manifest, exported)
    shardings = exported.in_shardings_jax(self.mesh)
    n_weights = len(weights)
    self._input_shardings = shardings[n_weights:]
    self.weights = [_place(w, s, self.mesh) for w, s in zip(weights, shardings[:n_weights])]
    self._call = jax.jit(lambda w, x: exported.call(*w, *x))

  @property
  def task(self) -> str:
    return self.manifest["task"]

  def _columns(self, inputs: Mapping) -> tuple[list[np.ndarray], int]:
    if not isinstance(inputs, Mapping):
      raise InputError(f"pass the inputs as a dict keyed by name ({', '.join(self.input_names)}), "
                       f"not a {type(inputs).__name__}.")
    unknown = [k for k in inputs if k not in self.inputs]
    if unknown:
      raise InputError(f"the artifact has no input {unknown[0]!r}; its inputs are "
                       f"{', '.join(self.input_names)}. Rename it, or drop it.")
    missing = [k for k in self.input_names if k not in inputs]
    if missing:
      raise InputError(f"the input {missing[0]!r} is missing (the artifact takes "
                       f"{', '.join(self.input_names)}); pass it, e.g. "
                       f"{_example(self.inputs[missing[0]])}.")
    columns, rows = [], None
    for name in self.input_names:
      columns.append(_column(name, self.inputs[name], inputs[name]))
      if rows is None:
        rows, first = len(columns[-1]), name
      elif len(columns[-1]) != rows:
        raise InputError(f"the input {name!r} has {len(columns[-1])} rows and {first!r} has "
                         f"{rows}; pass the same number of rows for every input.")
    return columns, rows

  def __call__(self, inputs: Mapping) -> dict[str, np.ndarray]:
    columns, rows = self._columns(inputs)
    outputs = [[] for _ in self.output_names]
    for start in range(0, max(rows, 1), self.batch_size):
      chunk = [_pad(c[start:start + self.batch_size], self.batch_size, self.inputs[n])
               for c, n in zip(columns, self.input_names)]
      placed = [_place(c, s, self.mesh) for c, s in zip(chunk, self._input_shardings)]
      for out, result in zip(outputs, self._call(self.weights, placed)):
        out.append(np.asarray(result))
    return {name: np.concatenate(out)[:rows] for name, out in zip(self.output_names, outputs)}

  def resident(self, table: str) -> dict[int, int]:
    """The id -> row map the artifact carries for dynamic table ``table``.

    Returns:
      Every resident raw id (its uint64 value) and its row.
    """
    tables = self.manifest.get("dynamic_tables", {})
    if table not in tables:
      raise KeyError(f"the artifact has no dynamic table {table!r}; its dynamic tables are "
                     f"{sorted(tables) or 'none'}.")
    index = {w["name"]: i for i, w in enumerate(self.manifest["weights"])}
    entry = tables[table]
    return raw_ids.map_of(*(np.asarray(self.weights[index[entry[k]]])
                            for k in ("keys_hi", "keys_lo", "score")))

  def __repr__(self) -> str:
    return (f"ServedModel({self.directory!r}, task={self.task!r}, inputs={self.input_names}, "
            f"outputs={self.output_names}, platforms={tuple(self.manifest['programs'])}, "
            f"devices={self.exported.nr_devices})")


def _example(spec: dict) -> str:
  shape = ", ".join(["batch"] + [str(d) for d in spec["shape"]])
  if spec["kind"] == RAW_IDS:
    return f"raw ids of any integer dtype (int64 or uint64 for 64-bit ids) of shape ({shape})"
  return f"an array of {spec['dtype']} of shape ({shape})"


def _column(name: str, spec: dict, value) -> np.ndarray:
  """One input as the program's dtype, its kind and shape checked."""
  try:
    array = np.asarray(value)
  except Exception as e:  # noqa: BLE001 (anything numpy can't hold is the caller's to fix)
    raise InputError(f"the input {name!r} is not an array ({e}); pass {_example(spec)}.") from None
  kind = array.dtype.kind
  if spec["kind"] in (IDS, RAW_IDS) and kind not in "iu":
    raise InputError(f"the input {name!r} has dtype {array.dtype}, not integer ids; pass "
                     f"{_example(spec)} (any integer dtype).")
  wanted = np.dtype(spec["dtype"]).kind
  if spec["kind"] == DENSE and wanted == "f" and kind != "f":
    raise InputError(f"the input {name!r} has dtype {array.dtype}, not floats; pass "
                     f"{_example(spec)}.")
  if spec["kind"] == DENSE and wanted in "iu" and kind not in "iu":
    raise InputError(f"the input {name!r} has dtype {array.dtype}, not integers; pass "
                     f"{_example(spec)}.")
  if array.ndim != 1 + len(spec["shape"]) or list(array.shape[1:]) != list(spec["shape"]):
    raise InputError(f"the input {name!r} has shape {array.shape}; pass {_example(spec)}.")
  if spec["kind"] == RAW_IDS:
    words, bad = raw_ids.host_words(array, spec.get("id_dtype"))
    if bad is not None:
      low, high = raw_ids.id_range(spec.get("id_dtype"))
      raise InputError(f"the input {name!r} holds the raw id {bad}, outside its table's "
                       f"id_dtype {spec.get('id_dtype')} ([{low}, {high}], -1 is padding); "
                       "fix the ids (the table was trained on that range).")
    return words
  if spec["kind"] == IDS:
    valid = invalid_ids.valid_mask(array, int(spec["num_embeddings"]))
    ids = np.full(array.shape, -1, spec["dtype"])  # -1 fits no unsigned dtype: fill, then copy
    ids[valid] = array[valid]
    return ids
  return array.astype(spec["dtype"])


def _pad(x: np.ndarray, rows: int, spec: dict) -> np.ndarray:
  if len(x) == rows:
    return x
  if spec["kind"] == RAW_IDS:
    return np.concatenate([x, raw_ids.padding((rows - len(x),) + x.shape[1:-1])])
  fill = -1 if spec["kind"] == IDS else 0
  return np.concatenate([x, np.full((rows - len(x),) + x.shape[1:], fill, x.dtype)])


def _place(x, sharding, mesh):
  """``x`` (numpy or memory-mapped) on the mesh, each device reading only its own slice."""
  if sharding is None:
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.make_array_from_callback(x.shape, sharding, lambda index: np.asarray(x[index]))


def load(directory: str) -> ServedModel:
  """Loads an artifact written by ``python -m train.export``.

  Checks every file's sha256 against the manifest, then places the weights
  on this machine's devices in the layouts they were exported with.

  Args:
    directory: the artifact's directory (the export's ``--out``).

  Returns:
    A ``ServedModel``: call it with a dict of named inputs.

  Raises:
    ArtifactError: a file is missing, corrupt or changed.
    PlatformError: the artifact was exported for another platform, or for
      more devices than this machine has.
  """
  directory = str(directory)
  manifest = artifact.read_manifest(directory)
  chosen = platform(directory, manifest)
  try:
    exported = export.deserialize(bytearray(artifact.read_program(directory, manifest, chosen)))
  except Exception as e:  # noqa: BLE001 (a flatbuffer that passed its hash but not jax)
    raise artifact.ArtifactError(
        f"{directory}/{manifest['programs'][chosen]} can't be read by jax {jax.__version__} "
        f"({e}); export the model again with this jax.") from None
  weights = []
  for i, entry in enumerate(manifest["weights"]):
    array = artifact.read_weight(directory, manifest, entry)
    aval = exported.in_avals[i]
    if tuple(array.shape) != tuple(aval.shape) or array.dtype != aval.dtype:
      raise artifact.ArtifactError(
          f"{directory}/{entry['file']} holds {array.dtype} {array.shape}, the program takes "
          f"{aval.dtype} {aval.shape} for weight {entry.get('name')!r}; the files don't "
          "belong together: export the model again.")
    weights.append(array)
  expected = len(weights) + len(manifest["inputs"])
  if len(exported.in_avals) != expected:
    raise artifact.ArtifactError(
        f"{directory}/{artifact.MANIFEST} lists {len(weights)} weights and "
        f"{len(manifest['inputs'])} inputs, the program takes {len(exported.in_avals)} "
        "arguments; export the model again.")
  return ServedModel(directory, manifest, exported, weights)
