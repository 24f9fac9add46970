"""Each bad input gets one error naming the thing and the fix, never another answer."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from embedlib import serving
from embedlib.serving import artifact as artifact_lib
from embedlib.training import export_lib


@pytest.fixture(scope="module")
def served(artifact):
  return serving.load(artifact)


def _good(served, rows=4):
  out = {"dense": np.zeros((rows, 13), np.float32)}
  out.update({name: np.zeros(rows, np.int32) for name in served.input_names[1:]})
  return out


@pytest.mark.parametrize("change, match", [
    (lambda x: x.update(f4=x["f0"]), r"no input 'f4'; its inputs are dense, f0, f1, f2, f3\. "
                                     r".*drop it"),
    (lambda x: x.pop("f3"), r"the input 'f3' is missing .*pass it, e\.g\. an array of int32 of "
                            r"shape \(batch\)"),
    (lambda x: x.update(f1=x["f1"].astype(np.float32)), r"'f1' has dtype float32, not integer "
                                                         r"ids; pass an array of int32"),
    (lambda x: x.update(dense=x["dense"].astype(np.int32)), r"'dense' has dtype int32, not "
                                                            r"floats"),
    (lambda x: x.update(dense=x["dense"][:, :12]), r"'dense' has shape \(4, 12\); pass an "
                                                   r"array of float32 of shape \(batch, 13\)"),
    (lambda x: x.update(f2=x["f2"][:, None]), r"'f2' has shape \(4, 1\)"),
    (lambda x: x.update(f3=x["f3"][:3]), r"'f3' has 3 rows and 'dense' has 4"),
])
def test_a_bad_input_is_one_error_naming_it(served, change, match):
  inputs = _good(served)
  change(inputs)
  with pytest.raises(serving.InputError, match=match):
    served(inputs)


def test_inputs_must_be_a_dict(served):
  with pytest.raises(serving.InputError, match="as a dict keyed by name"):
    served([np.zeros((1, 13))])


def test_out_of_range_ids_follow_the_invalid_id_rule(served):
  """Past the table, negative, past int64's int32 part: all look up what -1 (padding) does."""
  inputs = _good(served, rows=5)
  pad = dict(inputs, f3=np.full(5, -1, np.int32))
  odd = dict(inputs, f3=np.array([1000, 10**6, -2, 2**32, 2**40 + 1], np.int64))
  np.testing.assert_array_equal(served(odd)["probability"], served(pad)["probability"])
  assert not np.array_equal(served(dict(inputs, f3=np.full(5, 3)))["probability"],
                            served(pad)["probability"])


@pytest.fixture
def copy(artifact, tmp_path):
  """A private copy of the artifact, to damage."""
  return shutil.copytree(artifact, tmp_path / "copy")


def _manifest(path):
  return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, manifest):
  (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_changed_weight_file_names_the_file(copy):
  name = _manifest(copy)["weights"][3]["file"]
  data = bytearray((copy / name).read_bytes())
  data[-1] ^= 1
  (copy / name).write_bytes(bytes(data))
  with pytest.raises(serving.ArtifactError, match=rf"{name} has sha256 .* not the manifest's .*"
                                                  r"corrupt or was changed; export the model"):
    serving.load(copy)


def test_a_missing_weight_file_names_it(copy):
  name = _manifest(copy)["weights"][0]["file"]
  os.remove(copy / name)
  with pytest.raises(serving.ArtifactError, match=rf"{name} is missing from the artifact"):
    serving.load(copy)


def test_a_manifest_that_is_not_json_is_named(copy):
  (copy / "manifest.json").write_text('{"format": "embedlib.serving/1", ')
  with pytest.raises(serving.ArtifactError, match=r"manifest.json is not valid JSON"):
    serving.load(copy)


def test_a_missing_manifest_is_named(copy):
  os.remove(copy / "manifest.json")
  with pytest.raises(serving.ArtifactError, match=r"manifest.json is missing"):
    serving.load(copy)


def test_a_manifest_shape_that_disagrees_with_its_file_is_named(copy):
  manifest = _manifest(copy)
  manifest["weights"][2]["shape"] = [w + 1 for w in manifest["weights"][2]["shape"]]
  _write_manifest(copy, manifest)
  with pytest.raises(serving.ArtifactError, match=r"the manifest says weight .* is <f4"):
    serving.load(copy)


def test_a_weight_swapped_with_its_hash_still_fails_against_the_program(copy):
  """A file and hash replaced together: the program's own argument shapes refuse it."""
  manifest = _manifest(copy)
  entry = manifest["weights"][0]
  np.save(copy / entry["file"], np.zeros((3,), np.float32), allow_pickle=False)
  entry["shape"] = [3]
  manifest["files"][entry["file"]] = artifact_lib.sha256(str(copy / entry["file"]))
  _write_manifest(copy, manifest)
  with pytest.raises(serving.ArtifactError, match=r"the program takes float32 \(\d+,?\d*\) for "
                                                  r"weight .* don't belong together"):
    serving.load(copy)


def test_a_pickled_weight_is_refused_not_run(copy):
  manifest = _manifest(copy)
  entry = manifest["weights"][0]
  np.save(copy / entry["file"], np.array([{"x": 1}], dtype=object), allow_pickle=True)
  manifest["files"][entry["file"]] = artifact_lib.sha256(str(copy / entry["file"]))
  _write_manifest(copy, manifest)
  with pytest.raises(serving.ArtifactError, match=r"is not a plain .npy array"):
    serving.load(copy)


def test_a_file_outside_the_artifact_is_refused(copy):
  manifest = _manifest(copy)
  old = manifest["weights"][0]["file"]
  manifest["weights"][0]["file"] = "../../etc/passwd"
  manifest["files"]["../../etc/passwd"] = manifest["files"].pop(old)
  _write_manifest(copy, manifest)
  with pytest.raises(serving.ArtifactError, match=r"not inside the artifact"):
    serving.load(copy)


def test_platforms_the_machine_lacks_are_named_with_the_export_flag(copy):
  manifest = _manifest(copy)
  os.rename(copy / "program-cpu.jax", copy / "program-cuda.jax")
  manifest["programs"] = {"cuda": "program-cuda.jax"}
  manifest["files"]["program-cuda.jax"] = manifest["files"].pop("program-cpu.jax")
  _write_manifest(copy, manifest)
  with pytest.raises(serving.PlatformError, match=r"exported for cuda; this machine runs jax "
                                                  r"on cpu\. .*--platforms cuda,cpu"):
    serving.load(copy)


def test_more_devices_than_the_machine_has_are_named(copy, monkeypatch):
  monkeypatch.setattr(jax, "device_count", lambda: 0)
  with pytest.raises(serving.PlatformError, match=r"sharded over 1 devices; this machine has 0 "
                                                  r".*--devices 1"):
    serving.load(copy)


def test_export_refuses_a_workdir_without_a_run(tmp_path):
  with pytest.raises(export_lib.ExportError, match=r"config.json does not exist: .* not the "
                                                   r"workdir of a python -m train run"):
    export_lib.restore(str(tmp_path))


def test_export_refuses_a_non_empty_out_and_unknown_platforms(restored, tmp_path):
  config, model, mesh = restored
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("")
  with pytest.raises(export_lib.ExportError, match=r"exists and is not an empty directory"):
    export_lib.export(config, model, mesh, str(tmp_path / "full"))
  with pytest.raises(export_lib.ExportError, match=r"gpu is not a jax lowering platform; use "
                                                   r"some of cpu, cuda"):
    export_lib.export(config, model, mesh, str(tmp_path / "new"), platforms=("gpu",))
