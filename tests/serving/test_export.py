"""Export -> load -> score: the artifact equals the in-process model, bit for bit.

The loader runs in a fresh process that can't import flax, embedlib's model
code, its training code or the configs; the sharded artifact loads over a
4-device mesh in the layouts it was exported with.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import serving
from embedlib.training import export_lib

from tests.serving.conftest import ROOT, SERVED_TABLES


def _inputs(manifest, rows=37, seed=0):
  """Inputs of ``rows`` rows: ids of mixed dtypes, some out of range, int64 past int32 too."""
  rng = np.random.default_rng(seed)
  out = {"dense": rng.normal(size=(rows, 13)).astype(np.float32)}
  for i, spec in enumerate(manifest["inputs"][1:]):
    n = spec["num_embeddings"]
    ids = rng.integers(-3, n + 3, size=rows)
    out[spec["name"]] = ids.astype([np.int32, np.int64, np.uint16][i % 3] if n < 60_000
                                   else np.int64)
  first = manifest["inputs"][1]["name"]
  out[first] = out[first].astype(np.int64)
  out[first][:3] = [2**32 + 5, -(2**40), 7]
  return out


def test_the_artifact_equals_the_in_process_model_bit_for_bit(artifact, restored):
  config, model, _ = restored
  served = serving.load(artifact)
  assert served.input_names[0] == "dense" and served.output_names == ("probability",)
  inputs = _inputs(served.manifest)
  got = served(inputs)["probability"]
  # In-process: int32 ids, those outside [0, num_embeddings) looked up as the rule says.
  sizes = {s["name"]: s["num_embeddings"] for s in served.manifest["inputs"][1:]}
  ids = {k: np.where((v >= 0) & (v < sizes[k]), v.astype(np.int64), -1).astype(np.int32)
         for k, v in inputs.items() if k != "dense"}
  jitted = nnx.jit(lambda m, d, s: jax.nn.sigmoid(m(d, s)))
  size = served.manifest["batch_size"]

  def forward(dense, ids):
    """The model on the artifact's batches (the last one padded): XLA:CPU's products round
    by their shape, so the same model on other batch shapes may differ in the last bit."""
    pad = -len(dense) % size
    dense = np.pad(dense, ((0, pad), (0, 0)))
    ids = {k: np.pad(v, (0, pad), constant_values=-1) for k, v in ids.items()}
    return np.concatenate([
        jitted(model, dense[i:i + size], {k: v[i:i + size] for k, v in ids.items()})
        for i in range(0, len(dense), size)])[:len(dense) - pad]

  want = forward(inputs["dense"], ids)
  assert got.shape == (37,) and got.dtype == np.float32
  np.testing.assert_array_equal(got, want)
  # Out-of-range ids given to the model as they are follow the same rule.
  raw = {k: np.clip(v.astype(np.int64), -5, sizes[k] + 5).astype(np.int32)
         for k, v in inputs.items() if k != "dense"}
  np.testing.assert_array_equal(forward(inputs["dense"], raw), want)
  # Rows score independently of their batch: one row alone, and an empty batch.
  one = served({k: v[5:6] for k, v in inputs.items()})["probability"]
  np.testing.assert_array_equal(one, got[5:6])
  assert served({k: v[:0] for k, v in inputs.items()})["probability"].shape == (0,)


def test_the_manifest_describes_inputs_weights_and_files(artifact):
  manifest = json.loads((artifact / "manifest.json").read_text())
  assert manifest["task"] == "ctr" and list(manifest["programs"]) == ["cpu"]
  assert [s["name"] for s in manifest["inputs"]] == ["dense"] + [
      f"f{i}" for i in range(len(SERVED_TABLES))]
  assert manifest["inputs"][1] == {"name": "f0", "kind": "ids", "dtype": "int32", "shape": [],
                                   "num_embeddings": 1000}
  assert "zero vector" in manifest["invalid_ids"]
  assert set(manifest["files"]) == {"program-cpu.jax"} | {w["file"] for w in manifest["weights"]}
  for w in manifest["weights"]:  # plain .npy, no pickles
    array = np.load(artifact / w["file"], allow_pickle=False)
    assert array.dtype.str == w["dtype"] and list(array.shape) == w["shape"]
  # The tables are weights, not constants: every table's rows are in the files.
  tables = [w for w in manifest["weights"] if w["shape"][:1] == [1000]]
  assert len(tables) == len(SERVED_TABLES)


# Blocks flax, embedlib's model, training and data code, and the configs: what a
# server without the project's Python code has.
_FRESH = """
import importlib.abc, sys
BLOCKED = ("flax", "optax", "orbax", "ml_collections", "configs", "train", "embedlib.models",
           "embedlib.training", "embedlib.data", "embedlib.collection", "embedlib.embed",
           "embedlib.strategies", "embedlib.kernels")
class Blocker(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name in BLOCKED or name.startswith(tuple(b + "." for b in BLOCKED)):
      raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Blocker())
import numpy as np
import embedlib.serving
served = embedlib.serving.load(sys.argv[1])
inputs = dict(np.load(sys.argv[2], allow_pickle=False))
np.save(sys.argv[3], served(inputs)["probability"], allow_pickle=False)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "embedlib")))
"""


def test_a_fresh_process_without_flax_or_the_model_code_scores(artifact, tmp_path):
  served = serving.load(artifact)
  inputs = _inputs(served.manifest, rows=20, seed=1)
  np.savez(tmp_path / "in.npz", **inputs)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  # One CPU device, compiled with the flags this process compiles with (conftest's
  # -O0 changes float rounding, so bit equality needs the same flags).
  env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                              if "device_count" not in f)
  done = subprocess.run([sys.executable, "-c", _FRESH, str(artifact), str(tmp_path / "in.npz"),
                         str(tmp_path / "out.npy")], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "flax" not in done.stdout and "embedlib.models" not in done.stdout
  np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), served(inputs)["probability"])


def test_a_sharded_artifact_loads_sharded_in_its_layouts(artifact, restored, trained, tmp_path):
  config, _, _ = restored
  _, model, mesh = export_lib.restore(str(trained), devices=4)
  manifest = export_lib.export(config, model, mesh, str(tmp_path / "sharded"), batch_size=16)
  assert manifest["devices"] == 4 and manifest["mesh"]["shape"] == [4]
  served = serving.load(tmp_path / "sharded")
  assert served.mesh.size == 4
  score = export_lib.scoring(config, model, mesh)
  jitted, names, weights, _ = export_lib.serving_function(model, mesh, score, 16)
  assert [w["name"] for w in manifest["weights"]] == names
  split = 0
  for loaded, original in zip(served.weights, weights):
    assert loaded.sharding.spec == original.sharding.spec
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(original))
    split += loaded.sharding.spec != jax.sharding.PartitionSpec()
  assert split >= len(SERVED_TABLES)  # every table is split over the 4 devices
  inputs = _inputs(served.manifest, rows=16, seed=2)
  got = served(inputs)["probability"]
  columns, _ = served._columns(inputs)  # pylint: disable=protected-access
  want = np.asarray(jitted(*weights, *columns)[0])
  np.testing.assert_array_equal(got, want)
  one_device = serving.load(artifact)(inputs)["probability"]
  np.testing.assert_allclose(got, one_device, rtol=0, atol=1e-6)


# int8: the integer codes; bf16: a dtype .npy can't name, stored as its bits.
# int8 artifacts are scored bit for bit in CI by test_raw_ids.py and
# test_tasks.py: here -m slow.
@pytest.mark.parametrize("bits", [pytest.param(8, marks=pytest.mark.slow), "bf16"])
def test_a_quantized_artifact_equals_the_quantized_model_bit_for_bit(restored, tmp_path, bits):
  config, model, mesh = restored
  out = tmp_path / "q"
  manifest = export_lib.export(config, nnx.clone(model), mesh, str(out), batch_size=16, bits=bits)
  assert manifest["bits"] == bits
  table = next(w for w in manifest["weights"] if w["shape"][:1] == [1000])
  assert table["dtype"] == ("|u1" if bits == 8 else "<u2")  # codes, or bf16's bits
  served = serving.load(out)
  inputs = _inputs(served.manifest, rows=16, seed=3)
  quantized = embedlib.quantize(nnx.clone(model), bits=bits)
  sizes = {s["name"]: s["num_embeddings"] for s in served.manifest["inputs"][1:]}
  ids = {k: np.where((v >= 0) & (v < sizes[k]), v.astype(np.int64), -1).astype(np.int32)
         for k, v in inputs.items() if k != "dense"}
  want = nnx.jit(lambda m, d, s: jax.nn.sigmoid(m(d, s)))(quantized, inputs["dense"], ids)
  np.testing.assert_array_equal(served(inputs)["probability"], np.asarray(want))


def test_cpu_and_cuda_programs_each_with_their_own_kernels(artifact, restored, tmp_path):
  """Lowered on this CPU machine, one program per platform, neither with a CPU kernel.

  The CUDA program's lookups are XLA's gathers (``kernel="auto"`` on a GPU:
  measured faster than the Pallas kernels, `embedlib.kernels.gpu_choice`).
  """
  config, model, mesh = restored
  manifest = export_lib.export(config, model, mesh, str(tmp_path / "both"), batch_size=16,
                               platforms=("cpu", "cuda"))
  assert manifest["programs"] == {"cpu": "program-cpu.jax", "cuda": "program-cuda.jax"}
  texts = {}
  for platform, name in manifest["programs"].items():
    exported = jax.export.deserialize(bytearray((tmp_path / "both" / name).read_bytes()))
    assert exported.platforms == (platform,)
    texts[platform] = exported.mlir_module()
  assert "stablehlo.gather" in texts["cuda"] and "custom_call @embedlib_" not in texts["cuda"]
  assert "custom_call @embedlib_" not in texts["cpu"] and "gpu" not in texts["cpu"]
  served = serving.load(tmp_path / "both")  # this machine runs the CPU program
  inputs = _inputs(manifest, rows=8)
  np.testing.assert_array_equal(served(inputs)["probability"],
                                serving.load(artifact)(inputs)["probability"])
