"""A finished run's model as a serving artifact (``python -m train.export``).

``restore(workdir, devices)`` rebuilds the run's model from the config saved
in its workdir and its last checkpoint; ``export(...)`` serializes the task's
scoring function (``scoring``) with ``jax.export``, the model's state and
the task's extra arrays as explicit arguments (weights, never constants
baked into the program), and writes the artifact ``embedlib.serving`` loads.

The program holds no call into embedlib's C++ CPU kernels (their targets
exist only where embedlib is imported): it is traced with
``EMBEDLIB_CPU_KERNELS=0``, so its CPU lookups are XLA's gathers, the same
rows bit for bit, and the lowered text is checked for those targets.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import jax
import ml_collections
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import export_checks
from embedlib import quant as quantize_lib
from embedlib.kernels import cpu_library
from embedlib.serving import artifact
from embedlib.training import setup
from embedlib.training import train_lib
from embedlib.training.loop import Loop
from embedlib.training.tasks import task_name

from embedlib.training import scoring as scoring_lib

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


class ExportError(ValueError):
  """A workdir or an option that can't give an artifact; the message names it and the fix."""


def read_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run saved in ``workdir`` (``config.json``)."""
  path = os.path.join(workdir, train_lib.CONFIG_FILE)
  if not os.path.isfile(path):
    raise ExportError(f"{path} does not exist: {workdir} is not the workdir of a "
                      "python -m train run (or of one older than its config.json); pass the "
                      "--workdir a run trained in.")
  try:
    with open(path, encoding="utf-8") as f:
      # Dotted keys: a tabular run's config.data.columns may name a column "stats.count".
      return ml_collections.ConfigDict(json.load(f), allow_dotted_keys=True)
  except ValueError as e:
    raise ExportError(f"{path} is not a run's config ({e}); pass the --workdir of a "
                      "python -m train run.") from None


def check_out(out: str) -> None:
  """Raises unless ``out`` is free for an artifact: absent, or an empty directory."""
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ExportError(f"--out={out} exists and is not an empty directory; pass a new "
                      "directory, or remove this one.")


def serving_mesh(config, devices: int):
  """The run's mesh axes over the first ``devices`` devices, all on its first axis."""
  if not 1 <= devices <= jax.device_count():
    raise ExportError(f"--devices={devices}, but jax sees {jax.device_count()}; pass 1 to "
                      f"{jax.device_count()}.")
  axes = tuple(config.mesh_axes)
  shape = [devices] + [1] * (len(axes) - 1)
  return jax.make_mesh(tuple(shape), axes,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                       devices=jax.devices()[:devices])


def restore(workdir: str, devices: int = 1):
  """``(config, model, mesh)`` of the finished run in ``workdir``, on ``devices`` devices."""
  config = read_config(workdir)
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise ExportError(f"{workdir} has no checkpoints/; train the run first (python -m train "
                      f"--config ... --workdir {workdir}).")
  mesh = serving_mesh(config, devices)
  model, mesh = setup.restore_model(config, workdir, mesh=mesh)
  return config, model, mesh


def quantized(model, bits):
  """``model`` with its tables quantized in place (``embedlib.quantize``); itself for ``None``.

  ``bits``: 8 or 4 (row-wise integers with an fp16 scale and bias), ``"fp8"`` or ``"bf16"``.
  """
  if bits is None:
    return model
  return quantize_lib.quantize(model, bits=bits)


def scoring(config, model, mesh, *, top_k: int = 100, exclude_input: bool = False,
            workdir: str | None = None) -> scoring_lib.Scoring:
  """The serving program of ``config``'s task (``workdir``: the run's, where its task reads it)."""
  name = task_name(config)
  try:
    task = setup.task(config)
    if workdir is not None:  # what the run read (a tabular run's saved schema)
      task = task.for_workdir(workdir)
    spec = task.data_spec()
    if name == "ctr":
      return scoring_lib.ctr(config, spec, model)
    if name == "tabular":
      if workdir is None:
        raise ExportError("a tabular run's artifact carries its schema, read from the run's "
                          "workdir: pass workdir= (python -m train.export does).")
      return scoring_lib.tabular(task, model)
    if name == "retrieval":
      eval_source = None
      if not task.dynamic:  # the catalogue's authors; raw ids embed the resident movies
        _, eval_source = setup.sources(config, task, spec)
      return scoring_lib.retrieval(task, model, mesh, eval_source, top_k=top_k)
    if name == "sequential":
      score = scoring_lib.sequential(config, spec, top_k=top_k, exclude_input=exclude_input,
                                     model=model)
      if not task.raw_ids:  # dense ids: train.predict maps a file's ids through this
        score.info["data"]["raw_item_ids"] = _raw_item_ids(config.data.path)
      return score
  except ValueError as e:
    raise ExportError(str(e)) from None
  raise ExportError(f"config.task.name={name!r}: exporting serves ctr, retrieval, "
                    "sequential and tabular runs; export one of those, or serve this one "
                    "in-process.")


def _raw_item_ids(path: str) -> list:
  """The file's id of each dense item id (``[0]``: padding), so ``train.predict`` maps any file."""
  from embedlib.data import movielens  # pylint: disable=g-import-not-at-top

  return movielens.load(path).raw_item_ids.tolist()


@contextlib.contextmanager
def _xla_cpu_lookups():
  """Traces with the XLA ops on CPU: an artifact must not call embedlib's own C++ targets."""
  before = os.environ.get(cpu_library.ENV_SWITCH)
  os.environ[cpu_library.ENV_SWITCH] = "0"
  try:
    yield
  finally:
    if before is None:
      del os.environ[cpu_library.ENV_SWITCH]
    else:
      os.environ[cpu_library.ENV_SWITCH] = before


def serving_function(model, mesh, score: scoring_lib.Scoring, batch_size: int):
  """``(jitted, weight names, weights, example inputs)`` of ``score.fn`` over the model's state.

  ``jitted(*weights, *inputs)`` is the program ``program`` exports: its
  arguments are the weights (the model's state leaves, then
  ``score.extras``), in their layouts on ``mesh``, then the inputs,
  replicated; its outputs are replicated.
  """
  graphdef, state = nnx.split(model)
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  names = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
  leaves = [leaf for _, leaf in paths_leaves]
  extra_names = list(score.extras)
  replicated = NamedSharding(mesh, P())
  # An extra already on the mesh (the retrieval corpus, rows split over it) keeps its layout.
  extras = [x if isinstance(x, jax.Array) else jax.device_put(x, replicated)
            for x in (score.extras[k] for k in extra_names)]
  weights = [leaf if isinstance(leaf, jax.Array) else jax.device_put(leaf, replicated)
             for leaf in leaves] + extras
  n_state = len(leaves)

  def fn(*args):
    state_ = jax.tree.unflatten(treedef, args[:n_state])
    extras_ = dict(zip(extra_names, args[n_state:len(weights)]))
    return score.fn(nnx.merge(graphdef, state_), extras_, *args[len(weights):])

  inputs = [jax.device_put(x, replicated) for x in score.zeros(batch_size)]
  shardings = [w.sharding for w in weights] + [replicated] * len(inputs)
  jitted = jax.jit(fn, in_shardings=shardings, out_shardings=replicated)
  return jitted, names + extra_names, weights, inputs


def program(model, mesh, score: scoring_lib.Scoring, batch_size: int,
            platforms=("cpu",)) -> tuple[dict, list, list]:
  """``({platform: exported}, weight names, weights)`` of ``serving_function``.

  Each platform gets a program of its own: lowered for several at once, the
  kernels' per-platform branches inside ``shard_map`` are all compiled
  where it runs, and XLA:CPU has no handler for the GPU's kernels.
  """
  jitted, names, weights, inputs = serving_function(model, mesh, score, batch_size)
  programs = {}
  for platform in platforms:
    with _xla_cpu_lookups():
      programs[platform] = jax.export.export(
          jitted, platforms=(platform,), disabled_checks=export_checks.export_disabled_checks())(
              *weights, *inputs)
    text = programs[platform].mlir_module()
    found = [t for t in cpu_library.TARGETS if f"custom_call @{t}(" in text]
    if found:
      raise ExportError(f"the exported program calls embedlib's C++ CPU kernel {found[0]!r}, "
                        "which a server without embedlib can't run; this is a bug in the "
                        "export: report it.")
  return programs, names, weights


def dynamic_manifest(model, names: list, inputs: list) -> dict:
  """The manifest's ``dynamic_tables``: each dynamic table's map, as weights of the artifact.

  ``inputs``: the manifest's inputs; a table's ``features`` are those naming it.

  A row is resident when its ``score`` is ``>= 0``; its raw id is
  ``keys_hi << 32 | keys_lo`` (``embedlib.serving.raw_ids.map_of``). The
  program reads the map as it stood when exported, without admitting.
  """
  index = set(names)
  out = {}
  for table, (path, module) in scoring_lib.dynamic_tables(model).items():
    prefix = "".join(f"[{k!r}]" for k in path)
    features = [s["name"] for s in inputs if s.get("table") == table]
    entry = {"features": features, "capacity": module.policy.capacity,
             "bucket_size": module.policy.bucket_size,
             "num_buckets": module.policy.num_buckets, "default": module.default,
             "id_dtype": module.id_dtype, "resident": len(module.resident())}
    for key in ("keys_hi", "keys_lo", "score"):
      name = f"{prefix}[{key!r}].value"
      if name not in index:
        raise ExportError(f"dynamic table {table!r}: its map {key!r} is not among the "
                          f"exported weights (looked for {name}); this is a bug in the "
                          "export: report it.")
      entry[key] = name
    out[table] = entry
  return out


def export(config, model, mesh, out: str, *, batch_size: int | None = None,
           platforms=("cpu",), bits: int | None = None, top_k: int = 100,
           exclude_input: bool = False, workdir: str | None = None) -> dict:
  """Writes the serving artifact of ``model`` (``config``'s run) to ``out``; returns its manifest.

  Args:
    config: the run's config.
    model: the trained model, on ``mesh``.
    mesh: the mesh the program is exported on (its device count is the
      artifact's).
    out: the artifact's directory; written in a temporary directory beside
      it and renamed into place, so a failed export leaves none.
    batch_size: the program's batch (the loader splits and pads any batch
      into these); default ``config.batch_size``.
    platforms: lowering platforms, e.g. ``("cpu", "cuda")``.
    bits: quantize the tables to this many bits first (``quantized``).
    top_k: retrieval and sequential: how many items each row returns.
    exclude_input: sequential: leave a history's own items out of its top k.
    workdir: the run's workdir (a tabular run's schema is read from it).
  """
  bad = [p for p in platforms if p not in PLATFORMS]
  if bad or not platforms:
    raise ExportError(f"--platforms={','.join(platforms)}: {bad[0] if bad else 'none'} is not "
                      f"a jax lowering platform; use some of {', '.join(PLATFORMS)}.")
  batch_size = int(batch_size or Loop.from_config(config).batch_size)
  if batch_size < 1 or batch_size % mesh.size:
    raise ExportError(f"--batch_size={batch_size} must be a positive multiple of the "
                      f"{mesh.size} devices exported on.")
  check_out(out)
  model = quantized(model, bits)
  if hasattr(model, "eval"):
    model.eval()
  score = scoring(config, model, mesh, top_k=top_k, exclude_input=exclude_input,
                  workdir=workdir)
  programs, names, weights = program(model, mesh, score, batch_size, platforms)
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=".export-", dir=parent)
  try:
    for platform, exported in programs.items():
      with open(os.path.join(staging, artifact.program_file(platform)), "wb") as f:
        f.write(exported.serialize())
    entries = []
    for i, (name, weight) in enumerate(zip(names, weights)):
      entries.append(dict(artifact.write_weight(staging, i, weight), name=name))
    manifest = {
        "task": task_name(config), "batch_size": batch_size,
        "programs": {p: artifact.program_file(p) for p in programs}, "devices": mesh.size,
        "mesh": {"shape": list(mesh.devices.shape), "axis_names": list(mesh.axis_names)},
        "inputs": score.inputs, "outputs": score.outputs, "weights": entries,
        "bits": bits, "jax_version": jax.__version__,
        "invalid_ids": ("an id outside [0, num_embeddings) is looked up as a zero vector, "
                        "like the padding id -1 (embedlib.invalid_ids)"),
        **score.info,
    }
    dynamic = dynamic_manifest(model, names, score.inputs)
    if dynamic:
      manifest["dynamic_tables"] = dynamic
      manifest["invalid_ids"] += (
          "; a raw id (an input of kind raw_ids) that is not resident in its dynamic "
          "table's map reads the table's default row (zeros, or its learned shared row), "
          "and -1 or 2**64 - 1 is padding (zeros)")
    artifact.finish(staging, manifest)
    os.chmod(staging, 0o755)  # mkdtemp's 0700 would keep a server's user out
    if os.path.exists(out):
      os.rmdir(out)
    os.rename(staging, out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return manifest
