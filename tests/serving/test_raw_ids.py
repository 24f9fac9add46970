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
import shutil
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

from tests.serving.conftest import RAW_SMALL_BAGS, ROOT, raw_criteo_lines, run_module
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


def _inputs(seen, rows=24, seed=0):
  """Raw ids of ``raw_small``: half seen (resident), half never seen, of mixed dtypes.

  The first feature's ids lie past ``2**63`` (uint64), the others' past
  ``2**59``; padding, int64 and 32-bit ids too.
  """
  rng = np.random.default_rng(seed)
  out = {"dense": rng.normal(size=(rows, 13)).astype(np.float32)}
  for (name, pool), bag in zip(seen.items(), RAW_SMALL_BAGS):
    shape = (rows,) if bag == 1 else (rows, bag)
    known = rng.choice(pool, size=shape)
    unknown = pool[0] + np.uint64(2**57) + rng.integers(0, 2**40, size=shape).astype(np.uint64)
    out[name] = np.where((np.arange(rows) < rows // 2).reshape((rows,) + (1,) * (bag > 1)),
                         known, unknown)
  f0, f1, f2 = seen
  out[f0][-3:] = [2**64 - 5, 2**63 + 1, 2**64 - 1]  # the last one is padding
  out[f1] = out[f1].view(np.int64)  # int64 ids past 2**32
  out[f1][::5, 1] = -1  # padding inside bags
  out[f2] = out[f2].astype(np.int64)
  return out


def _eval_inputs(model, inputs):
  return _eval(model, inputs["dense"], {k: v for k, v in inputs.items() if k != "dense"})


def test_the_artifact_carries_each_dynamic_tables_map(raw_small):
  _, model, _, artifact, seen = raw_small
  served = serving.load(artifact)
  manifest = served.manifest
  f0, f1, _ = seen
  spec = {s["name"]: s for s in manifest["inputs"]}
  assert spec[f0] == {"name": f0, "kind": "raw_ids", "dtype": "uint32", "shape": [],
                      "table": f0, "id_dtype": None}
  assert spec[f1]["shape"] == [3]
  assert manifest["data"]["raw_ids"] is True and "not resident" in manifest["invalid_ids"]
  assert sorted(manifest["dynamic_tables"]) == sorted(seen)
  for name, table in model.embeddings.dynamic.items():
    entry = manifest["dynamic_tables"][name]
    assert entry["features"] == [name] and entry["default"] == "learned"
    assert entry["capacity"] == 256 and entry["num_buckets"] == 8
    resident = table.resident()
    assert served.resident(name) == resident == {int(v): resident[int(v)] for v in seen[name]}
    assert entry["resident"] == 40
  with pytest.raises(KeyError, match="no dynamic table 'C99'"):
    served.resident("C99")


def test_raw_ids_score_as_the_eval_mode_model_bit_for_bit(raw_small):
  _, model, _, artifact, seen = raw_small
  served = serving.load(artifact)
  inputs = _inputs(seen)
  f0, f1, f2 = seen
  before = model.embeddings.dynamic[f0].resident()
  got = served(inputs)["probability"]
  assert got.shape == (24,) and got.dtype == np.float32
  np.testing.assert_array_equal(got, _eval_inputs(model, inputs))
  # Looking up in eval mode admitted nothing: the map is what the artifact carries.
  assert model.embeddings.dynamic[f0].resident() == before
  # A signed id is its 64-bit pattern: int64 -5 is uint64 2**64 - 5.
  signed = dict(inputs, **{f0: inputs[f0].view(np.int64)})
  np.testing.assert_array_equal(served(signed)["probability"], got)
  # An unknown id reads the learned default row, unlike padding (zeros).
  unseen = dict(inputs, **{f2: np.full(24, 2**50 + 3, np.int64)})
  pad = dict(inputs, **{f2: np.full(24, -1, np.int64)})
  assert not np.array_equal(served(unseen)["probability"], served(pad)["probability"])
  np.testing.assert_array_equal(served(unseen)["probability"], _eval_inputs(model, unseen))
  # Rows score independently of their batch.
  np.testing.assert_array_equal(served({k: v[7:8] for k, v in inputs.items()})["probability"],
                                got[7:8])


def test_a_fresh_process_without_flax_or_the_model_code_scores_raw_ids(raw_small, tmp_path):
  artifact, seen = raw_small[3], raw_small[4]
  served = serving.load(artifact)
  inputs = _inputs(seen, rows=10, seed=1)
  np.savez(tmp_path / "in.npz", **inputs)
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                              if "device_count" not in f)
  done = subprocess.run([sys.executable, "-c", _FRESH, str(artifact),
                         str(tmp_path / "in.npz"), str(tmp_path / "out.npy")], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "flax" not in done.stdout and "embedlib.dynamic" not in done.stdout
  np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), served(inputs)["probability"])


def test_a_quantized_raw_id_artifact_equals_the_quantized_eval_model(raw_small, tmp_path):
  config, model, mesh, _, seen = raw_small
  f0 = next(iter(seen))
  manifest = export_lib.export(config, nnx.clone(model), mesh, str(tmp_path / "q"),
                               batch_size=16, bits=8)
  prefix = f"['embeddings']['dynamic'][{f0!r}]['rows']"
  rows = [w for w in manifest["weights"] if w["name"].startswith(prefix)]
  assert [w["dtype"] for w in rows] == ["|u1", "<f2"]  # the dynamic rows' codes, scale and bias
  served = serving.load(tmp_path / "q")
  assert served.resident(f0) == model.embeddings.dynamic[f0].resident()
  inputs = _inputs(seen, rows=16, seed=2)
  quantized = embedlib.quantize(nnx.clone(model), bits=8)
  np.testing.assert_array_equal(served(inputs)["probability"], _eval_inputs(quantized, inputs))


@pytest.mark.parametrize("change, match", [
    (lambda x, f: x.update({f[0]: x[f[0]].astype(np.float64)}),
     r"has dtype float64, not integer ids; pass raw ids of any integer dtype"),
    (lambda x, f: x.update({f[2]: x[f[2]][:, None]}), r"has shape \(4, 1\); pass raw ids"),
    (lambda x, f: x.update({f[1]: x[f[1]][:, :2]}), r"has shape \(4, 2\); pass raw ids .* "
                                                    r"shape \(batch, 3\)"),
    (lambda x, f: x.update({f[0]: np.array([1 << 70] * 4, object)}), r"has dtype object"),
])
def test_a_bad_raw_id_input_is_one_error_naming_it(raw_small, change, match):
  artifact, seen = raw_small[3], raw_small[4]
  served = serving.load(artifact)
  inputs = {k: v[:4] for k, v in _inputs(seen).items()}
  change(inputs, list(seen))
  with pytest.raises(serving.InputError, match=match):
    served(inputs)


def test_a_changed_map_file_is_an_error_naming_it(raw_small, tmp_path):
  copy = shutil.copytree(raw_small[3], tmp_path / "copy")
  manifest = json.loads((copy / "manifest.json").read_text())
  key = manifest["dynamic_tables"][next(iter(raw_small[4]))]["keys_lo"]
  name = next(w["file"] for w in manifest["weights"] if w["name"] == key)
  data = bytearray((copy / name).read_bytes())
  data[-1] ^= 1  # one resident id becomes another
  (copy / name).write_bytes(bytes(data))
  with pytest.raises(serving.ArtifactError, match=rf"{name} has sha256 .* corrupt or was changed"):
    serving.load(copy)


def test_a_raw_id_outside_its_tables_id_dtype_is_an_error_naming_it():
  from embedlib.serving import model as model_lib  # pylint: disable=g-import-not-at-top

  spec = {"name": "user", "kind": "raw_ids", "dtype": "uint32", "shape": [], "table": "user",
          "id_dtype": "int32"}
  words = model_lib._column("user", spec, np.array([-1, 2**31 - 1, -(2**31)], np.int64))
  assert words.tolist() == [[2**32 - 1] * 2, [0, 2**31 - 1], [2**32 - 1, 2**31]]
  with pytest.raises(serving.InputError, match=r"'user' holds the raw id 2147483648, outside "
                                               r"its table's id_dtype int32"):
    model_lib._column("user", spec, np.array([5, 2**31], np.int64))


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


@pytest.mark.slow
def test_a_sharded_raw_id_artifact_splits_each_map_with_its_rows(raw_trained, raw_restored,
                                                                raw_artifact, tmp_path):
  config, _, _ = raw_restored
  _, model, mesh = export_lib.restore(str(raw_trained[0]), devices=4)
  manifest = export_lib.export(config, model, mesh, str(tmp_path / "s"), batch_size=16)
  served = serving.load(tmp_path / "s")
  assert served.mesh.size == 4
  index = {w["name"]: i for i, w in enumerate(manifest["weights"])}
  for key in ("keys_hi", "keys_lo", "score"):  # the map lives where its rows do
    spec = served.weights[index[manifest["dynamic_tables"]["C1"][key]]].sharding.spec
    assert spec != jax.sharding.PartitionSpec(), key
  one = serving.load(raw_artifact)
  assert served.resident("C1") == one.resident("C1")
  batch = _batch(raw_criteo_lines(8, start=5) + raw_criteo_lines(8, start=700, distinct=10**6))
  inputs = {"dense": batch["dense"], **batch["sparse"]}
  # The dense layers may partition differently over 4 devices: the last bit may differ.
  np.testing.assert_allclose(served(inputs)["probability"], one(inputs)["probability"],
                             rtol=0, atol=1e-6)


@pytest.mark.slow
def test_predict_scores_a_raw_id_criteo_file_as_the_eval_mode_model(raw_artifact, raw_restored,
                                                                      tmp_path):
  """``python -m train.export`` of a raw-id Criteo workdir, then ``python -m train.predict``."""
  _, model, _ = raw_restored
  served = serving.load(raw_artifact)
  for name, table in model.embeddings.dynamic.items():
    assert served.resident(name) == table.resident()
  assert len(served.resident("C1")) >= 32
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
  known = np.array([int(v) in served.resident("C1") for v in batch["sparse"]["C1"]])
  assert known[:20].all() and not known[20:].any()  # resident ids and unknown ones
  np.testing.assert_array_equal(got, _eval(model, batch["dense"], batch["sparse"]))
