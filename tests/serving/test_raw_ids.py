"""A run with raw ids (dynamic tables) as an artifact: its maps travel, scores equal eval mode.

The artifact carries each dynamic table's id -> row map; a resident raw id
reads its row and any other id its table's default (here a learned row),
64-bit ids exactly, and the loader still needs neither flax nor the model
code. Every comparison is bit for bit: the served program is the eval-mode
model's own lookups, exported, compiled with the same flags.
"""

import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import data as data_lib
from embedlib import dynamic, serving
from embedlib.dynamic import ids as dynamic_ids
from embedlib.serving import raw_ids
from embedlib.training import export_lib

from tests.serving.conftest import ROOT, raw_criteo_lines, run_module
from tests.serving.test_export import _FRESH


def _eval(model, dense, sparse):
  """The in-process eval-mode probabilities of raw ids (split into words on the host)."""
  words = {k: dynamic.words(v) for k, v in sparse.items()}
  return np.asarray(nnx.jit(lambda m, d, s: jax.nn.sigmoid(m(d, s)))(model, dense, words))


def _batch(text: str):
  """The raw-id batch a Criteo reader (``raw_ids=True``) makes of ``text``'s lines."""
  rows = [data_lib.criteo.parse_line(line) for line in text.splitlines(True)]
  spec = data_lib.criteo_spec([1000] * 26)
  with tempfile.NamedTemporaryFile("w", suffix=".tsv") as f:
    f.write(text)
    f.flush()
    return data_lib.CriteoReader(f.name, spec, batch_size=1, raw_ids=True).assemble(rows)


def _inputs(rows=24, seed=0):
  """Raw ids the run saw (resident) and never saw, past 2**32 and 2**63, of mixed dtypes."""
  batch = _batch(raw_criteo_lines(rows // 2, start=0) +
                 raw_criteo_lines(rows - rows // 2, start=1000, distinct=10**6))
  rng = np.random.default_rng(seed)
  inputs = {"dense": rng.normal(size=(rows, 13)).astype(np.float32), **batch["sparse"]}
  inputs["C2"] = inputs["C2"].astype(np.uint64)
  inputs["C2"][:3] = [2**64 - 5, 2**63 + 1, 2**64 - 1]  # the last one is padding
  inputs["C3"] = np.where(np.arange(rows) % 5 == 0, -1, inputs["C3"])  # padding
  inputs["C4"] = (inputs["C4"] % 1000).astype(np.int32)  # 32-bit ids are raw ids too
  return inputs


def test_the_artifact_carries_each_dynamic_tables_map(raw_artifact, raw_restored):
  _, model, _ = raw_restored
  served = serving.load(raw_artifact)
  manifest = served.manifest
  assert manifest["inputs"][1] == {"name": "C1", "kind": "raw_ids", "dtype": "uint32",
                                   "shape": [], "table": "C1", "id_dtype": None}
  assert manifest["data"]["raw_ids"] is True and "not resident" in manifest["invalid_ids"]
  assert sorted(manifest["dynamic_tables"]) == sorted(f"C{i}" for i in range(1, 27))
  for name, table in model.embeddings.dynamic.items():
    entry = manifest["dynamic_tables"][name]
    assert entry["features"] == [name] and entry["default"] == "learned"
    assert entry["capacity"] == 256 and entry["num_buckets"] == 8
    resident = table.resident()
    assert served.resident(name) == resident and entry["resident"] == len(resident)
    if name == "C26":  # every line misses it: one id, MISSING_RAW
      assert resident == {data_lib.criteo.MISSING_RAW: resident[data_lib.criteo.MISSING_RAW]}
    else:
      assert len(resident) >= 32 and all(2**59 <= v < 2**60 for v in resident)
  with pytest.raises(KeyError, match="no dynamic table 'C99'"):
    served.resident("C99")


def test_raw_ids_score_as_the_eval_mode_model_bit_for_bit(raw_artifact, raw_restored):
  _, model, _ = raw_restored
  served = serving.load(raw_artifact)
  inputs = _inputs()
  c1 = served.resident("C1")
  known = np.array([int(v) in c1 for v in inputs["C1"]])
  assert known[:12].all() and not known[12:].any()  # both kinds of id are scored
  got = served(inputs)["probability"]
  want = _eval(model, inputs["dense"], {k: v for k, v in inputs.items() if k != "dense"})
  assert got.shape == (24,) and got.dtype == np.float32
  np.testing.assert_array_equal(got, want)
  # Looking up in eval mode admitted nothing: the map is what the artifact carries.
  assert model.embeddings.dynamic["C1"].resident() == c1
  # A signed id is its 64-bit pattern: int64 -5 is uint64 2**64 - 5.
  signed = dict(inputs, C2=inputs["C2"].view(np.int64))
  np.testing.assert_array_equal(served(signed)["probability"], got)
  # An unknown id reads the learned default row, unlike padding (zeros).
  unseen = dict(inputs, C5=np.full(24, 2**50 + 3, np.int64))
  pad = dict(inputs, C5=np.full(24, -1, np.int64))
  assert not np.array_equal(served(unseen)["probability"], served(pad)["probability"])
  # Rows score independently of their batch.
  np.testing.assert_array_equal(served({k: v[7:8] for k, v in inputs.items()})["probability"],
                                got[7:8])


def test_a_fresh_process_without_flax_or_the_model_code_scores_raw_ids(raw_artifact, tmp_path):
  served = serving.load(raw_artifact)
  inputs = _inputs(rows=10, seed=1)
  np.savez(tmp_path / "in.npz", **inputs)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                              if "device_count" not in f)
  done = subprocess.run([sys.executable, "-c", _FRESH, str(raw_artifact),
                         str(tmp_path / "in.npz"), str(tmp_path / "out.npy")], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "flax" not in done.stdout and "embedlib.dynamic" not in done.stdout
  np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), served(inputs)["probability"])


def test_predict_scores_a_raw_id_criteo_file_as_the_eval_mode_model(raw_artifact, raw_restored,
                                                                      tmp_path):
  _, model, _ = raw_restored
  text = raw_criteo_lines(20, start=3) + raw_criteo_lines(13, start=500, distinct=10**6)
  path = tmp_path / "score.tsv"
  path.write_text(text)
  out = tmp_path / "scores.txt"
  done = run_module("train.predict", f"--model={raw_artifact}", f"--data={path}",
                    f"--out={out}", "--batch_size=16")
  assert done.returncode == 0, done.stderr[-3000:]
  got = np.array([float(x) for x in out.read_text().splitlines()], np.float32)
  batch = _batch(text)
  assert batch["sparse"]["C26"][0] == data_lib.criteo.MISSING_RAW  # exact past 2**32
  np.testing.assert_array_equal(got, _eval(model, batch["dense"], batch["sparse"]))


def test_a_quantized_raw_id_artifact_equals_the_quantized_eval_model(raw_restored, tmp_path):
  config, model, mesh = raw_restored
  manifest = export_lib.export(config, nnx.clone(model), mesh, str(tmp_path / "q"),
                               batch_size=16, bits=8)
  rows = [w for w in manifest["weights"] if w["name"].startswith("['embeddings']['dynamic']['C1']"
                                                                 "['rows']")]
  assert [w["dtype"] for w in rows] == ["|u1", "<f2"]  # the dynamic rows' codes, scale and bias
  served = serving.load(tmp_path / "q")
  assert served.resident("C1") == model.embeddings.dynamic["C1"].resident()
  inputs = _inputs(rows=16, seed=2)
  quantized = embedlib.quantize(nnx.clone(model), bits=8)
  want = _eval(quantized, inputs["dense"], {k: v for k, v in inputs.items() if k != "dense"})
  np.testing.assert_array_equal(served(inputs)["probability"], want)


@pytest.mark.parametrize("change, match", [
    (lambda x: x.update(C1=x["C1"].astype(np.float64)), r"'C1' has dtype float64, not integer "
                                                          r"ids; pass raw ids of any integer"),
    (lambda x: x.update(C2=x["C2"][:, None]), r"'C2' has shape \(4, 1\); pass raw ids"),
    (lambda x: x.update(C3=np.array([1 << 70] * 4, object)), r"'C3' has dtype object"),
])
def test_a_bad_raw_id_input_is_one_error_naming_it(raw_artifact, change, match):
  served = serving.load(raw_artifact)
  inputs = {k: v[:4] for k, v in _inputs().items()}
  change(inputs)
  with pytest.raises(serving.InputError, match=match):
    served(inputs)


def test_a_changed_map_file_is_an_error_naming_it(raw_artifact, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top

  copy = shutil.copytree(raw_artifact, tmp_path / "copy")
  manifest = json.loads((copy / "manifest.json").read_text())
  key = manifest["dynamic_tables"]["C7"]["keys_lo"]
  name = next(w["file"] for w in manifest["weights"] if w["name"] == key)
  data = bytearray((copy / name).read_bytes())
  data[-1] ^= 1  # one resident id becomes another
  (copy / name).write_bytes(bytes(data))
  with pytest.raises(serving.ArtifactError, match=rf"{name} has sha256 .* corrupt or was changed"):
    serving.load(copy)


@pytest.mark.parametrize("id_dtype", [None, "int32", "uint32", "int64", "uint64"])
def test_the_servers_words_are_the_librarys(id_dtype):
  """``serving.raw_ids`` restates ``embedlib.dynamic.ids.host_words`` (numpy only): the same."""
  values = [0, 1, -1, 7, 2**31 - 1, -(2**31), 2**32 + 5, 2**63 - 1, -(2**63), -5]
  for dtype in (np.int32, np.int64, np.uint32, np.uint64, np.int8, np.uint16):
    info = np.iinfo(dtype)
    ids = np.array([v for v in values if info.min <= v <= info.max] +
                   ([2**64 - 1, 2**64 - 3] if dtype == np.uint64 else []), np.int64 if
                   dtype != np.uint64 else object).astype(dtype)
    words, bad = raw_ids.host_words(ids, id_dtype)
    try:
      want = dynamic_ids.host_words(ids, id_dtype=id_dtype, name="t")
    except ValueError as e:
      assert bad is not None and str(bad) in str(e)
      continue
    assert bad is None
    np.testing.assert_array_equal(words, want)
    assert words.dtype == np.uint32 and words.shape == ids.shape + (2,)
