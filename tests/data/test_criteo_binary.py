"""The binary Criteo format: the TSV reader's batches from records, resume, and every bad input."""

import json
import os

import numpy as np
import pytest

from embedlib.data import CriteoReader, criteo_binary
from embedlib.data.criteo import CriteoFormatError
from embedlib.data.criteo_binary import CriteoBinaryReader, convert
from tests.data.test_criteo_reader import SPEC, numbered_lines, write

SIZES = [f.num_embeddings for f in SPEC.features]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """A 103-line TSV file and its two conversions: hashed into SPEC's sizes, and raw."""
  tmp = tmp_path_factory.mktemp("binary")
  path = write(tmp, numbered_lines(103))
  convert([path], str(tmp / "hashed"), table_sizes=SIZES)
  convert([path], str(tmp / "raw"), raw_ids=True)
  return path, str(tmp / "hashed"), str(tmp / "raw")


def assert_same_batches(a, b):
  assert len(a) == len(b) > 0
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["label"], y["label"])
    np.testing.assert_array_equal(x["dense"], y["dense"])
    assert x["sparse"].keys() == y["sparse"].keys()
    for name in x["sparse"]:
      assert x["sparse"][name].dtype == y["sparse"][name].dtype
      np.testing.assert_array_equal(x["sparse"][name], y["sparse"][name])


@pytest.mark.parametrize("stored, raw_ids", [("hashed", False), ("raw", True), ("raw", False)])
@pytest.mark.parametrize("share", [
    {}, {"process_index": 1, "process_count": 2}, {"holdout": 0.3},
    {"holdout": 0.3, "split": "holdout", "process_count": 2}])
def test_batches_equal_the_tsv_readers(files, stored, raw_ids, share):
  path, hashed, raw = files
  kw = dict(batch_size=6, num_epochs=2, raw_ids=raw_ids, **share)
  tsv = CriteoReader(path, SPEC, **kw)
  binary = CriteoBinaryReader(hashed if stored == "hashed" else raw, SPEC, **kw)
  assert_same_batches(list(tsv), list(binary))
  assert binary.dropped_examples == tsv.dropped_examples


def test_resume_is_exact_across_epochs(files):
  _, hashed, _ = files
  reader = CriteoBinaryReader(hashed, SPEC, batch_size=6, num_epochs=2)
  for _ in range(20):  # 17 batches an epoch: into the second
    next(reader)
  state = reader.get_state()
  rest = list(reader)
  resumed = CriteoBinaryReader(hashed, SPEC, batch_size=6, num_epochs=2)
  resumed.set_state(state)
  assert state == {"position": 20, "epoch": 1, "line": 18}
  assert_same_batches(list(resumed), rest)
  assert resumed.dropped_examples == reader.dropped_examples == 2


def test_the_command_writes_what_convert_writes(files, tmp_path, capsys):
  path, hashed, _ = files
  assert criteo_binary.main(["--in", path, "--out", str(tmp_path / "cli"), "--table-sizes",
                             ",".join(map(str, SIZES))]) == 0
  assert "wrote 103 records (hashed ids)" in capsys.readouterr().out
  for name in ("records.bin", "meta.json"):
    with open(os.path.join(hashed, name), "rb") as a, open(tmp_path / "cli" / name, "rb") as b:
      assert a.read() == b.read()
  assert criteo_binary.main(["--in", str(tmp_path / "nope.tsv"), "--out", str(tmp_path / "x"),
                             "--raw-ids"]) == 1
  assert "nope.tsv' does not exist" in capsys.readouterr().err


def _copy(src, dst, edit=None, cut=0):
  os.makedirs(dst)
  with open(os.path.join(src, "meta.json")) as f:
    meta = json.load(f)
  with open(os.path.join(dst, "meta.json"), "w") as f:
    json.dump(edit(meta) if edit else meta, f)
  with open(os.path.join(src, "records.bin"), "rb") as f:
    data = f.read()
  with open(os.path.join(dst, "records.bin"), "wb") as f:
    f.write(data[:len(data) - cut])
  return str(dst)


def test_bad_inputs_name_the_file_and_the_fix(files, tmp_path):
  path, hashed, _ = files
  fix = r"python -m embedlib.data.criteo_binary --in DAY.tsv --out "
  with pytest.raises(FileNotFoundError, match=rf"'{tmp_path}/nope' does not exist; .*{fix}"):
    CriteoBinaryReader(str(tmp_path / "nope"), SPEC, batch_size=2)
  with pytest.raises(NotADirectoryError, match=r"data.tsv' is a file.*format='tsv'"):
    CriteoBinaryReader(path, SPEC, batch_size=2)
  truncated = _copy(hashed, tmp_path / "cut", cut=7)
  with pytest.raises(CriteoFormatError, match=r"cut/records.bin holds 16,473 bytes, and meta.json "
                     r"says 103 records of 160 bytes \(16,480 bytes\): the file is truncated"):
    CriteoBinaryReader(truncated, SPEC, batch_size=2)
  old = _copy(hashed, tmp_path / "v0", edit=lambda m: {**m, "version": 0})
  with pytest.raises(CriteoFormatError, match=r"v0/meta.json: format version 0, and this embedlib "
                     rf"reads version 1; write the directory again .*{fix}"):
    CriteoBinaryReader(old, SPEC, batch_size=2)
  os.makedirs(tmp_path / "empty")
  with pytest.raises(CriteoFormatError, match=r"empty/meta.json is missing: .* not a finished"):
    CriteoBinaryReader(str(tmp_path / "empty"), SPEC, batch_size=2)
  with pytest.raises(ValueError, match=r"hashed into table sizes \[100, 100, .*set config.data."
                     r"table_sizes to the directory's, or write it again with --table-sizes 7,"):
    CriteoBinaryReader(hashed, criteo_binary_spec(7), batch_size=2)
  with pytest.raises(ValueError, match="holds hashed ids, not raw ones; write it with --raw-ids"):
    CriteoBinaryReader(hashed, SPEC, batch_size=2, raw_ids=True)
  with pytest.raises(CriteoFormatError, match="fewer than batch_size=200 records"):
    next(CriteoBinaryReader(hashed, SPEC, batch_size=200))


def criteo_binary_spec(n):
  from embedlib.data import criteo_spec  # pylint: disable=g-import-not-at-top
  return criteo_spec(n)
