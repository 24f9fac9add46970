"""The Criteo-format generator: the layout and quirks, read back by CriteoReader, per seed."""

import gzip
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from embedlib.data import CriteoReader, criteo_spec
from embedlib.data import criteo_synth
from embedlib.data.criteo_synth import CriteoSynth

LINES = 600
HEX8 = re.compile(r"[0-9a-f]{8}")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  path = tmp_path_factory.mktemp("synth") / "day.tsv"
  CriteoSynth(seed=3).write(path, LINES)
  return str(path), path.read_text().splitlines()


def test_fields_have_the_real_quirks(written):
  _, lines = written
  fields = [line.split("\t") for line in lines]
  assert len(lines) == LINES and {len(f) for f in fields} == {40}
  assert {f[0] for f in fields} == {"0", "1"}
  ints = [v for f in fields for v in f[1:14]]
  cats = [v for f in fields for v in f[14:]]
  assert all(v == "" or re.fullmatch(r"-?[0-9]+", v) for v in ints)
  assert any(v.startswith("-") for v in ints), "no negative integer"
  assert all(v == "" or HEX8.fullmatch(v) for v in cats)
  assert 0 < ints.count("") < len(ints) and 0 < cats.count("") < len(cats)
  # I12 is mostly empty, I2 never, as in the real files.
  assert sum(f[12] == "" for f in fields) > LINES / 2
  assert all(f[2] != "" for f in fields)


def test_reads_back_through_criteo_reader(written):
  path, lines = written
  fields = [line.split("\t") for line in lines]
  reader = CriteoReader(path, criteo_spec(1000), batch_size=100)
  batches = list(reader)
  assert len(batches) == LINES // 100 and reader.bad_lines.count == 0
  labels = np.concatenate([b["label"] for b in batches])
  np.testing.assert_array_equal(labels, [float(f[0]) for f in fields])
  ids = np.stack([np.concatenate([b["sparse"][f"C{i + 1}"] for b in batches])
                  for i in range(26)], axis=1)
  empty = np.array([[v == "" for v in f[14:]] for f in fields])
  np.testing.assert_array_equal(ids == 0, empty)  # row 0 is "missing"
  dense = np.concatenate([b["dense"] for b in batches])
  want = np.array([[np.log1p(max(int(v), 0)) if v else 0.0 for v in f[1:14]] for f in fields])
  np.testing.assert_allclose(dense, want, rtol=1e-6)


def test_same_seed_same_bytes_and_shorter_is_a_prefix(tmp_path):
  a, b, c = tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "c.tsv"
  CriteoSynth(seed=1).write(a, criteo_synth.BLOCK + 10)
  CriteoSynth(seed=1).write(b, 50)
  CriteoSynth(seed=2).write(c, 50)
  assert a.read_bytes().startswith(b.read_bytes())
  assert b.read_bytes() != c.read_bytes()
  assert len(a.read_text().splitlines()) == criteo_synth.BLOCK + 10


def test_categoricals_are_skewed():
  lines, _ = next(CriteoSynth(seed=0).blocks(criteo_synth.BLOCK))
  c3 = [line.split("\t")[16] for line in lines]  # 100k values at vocab_scale=1
  counts = sorted((c3.count(v) for v in set(c3) - {""}), reverse=True)
  # Zipf: the top value is far above a uniform draw's (~0 or 1 of each).
  assert counts[0] > 0.05 * len(c3) and counts[-1] == 1


def test_planted_label_is_learnable_and_near_criteo_rate():
  synth = CriteoSynth(seed=0)
  blocks = list(synth.blocks(2 * criteo_synth.BLOCK))
  labels = np.concatenate([[float(l.split("\t", 1)[0]) for l in lines] for lines, _ in blocks])
  assert 0.15 < labels.mean() < 0.35
  oracle = criteo_synth.oracle_metrics(synth, len(labels), labels)
  assert oracle["auc"] > 0.75
  assert criteo_synth.planted_logits(synth, 10).shape == (10,)


def test_cli_writes_gzip(tmp_path):
  path = tmp_path / "day.tsv.gz"
  assert criteo_synth.main([str(path), "--lines", "200", "--seed", "4", "--gzip"]) == 0
  with gzip.open(path, "rt") as f:
    assert len(f.read().splitlines()) == 200
  reader = CriteoReader(str(path), criteo_spec(100), batch_size=50)
  assert sum(1 for _ in reader) == 4


def test_cli_refuses_gzip_without_a_gz_name(tmp_path, capsys):
  with pytest.raises(SystemExit):
    criteo_synth.main([str(tmp_path / "day.tsv"), "--lines", "5", "--gzip"])
  assert "day.tsv.gz" in capsys.readouterr().err


def test_module_runs_without_a_runpy_warning(tmp_path):
  # The package must not import its own entry point: runpy would warn that
  # criteo_synth was found in sys.modules before it ran as __main__.
  root = pathlib.Path(__file__).resolve().parents[2]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
  path = tmp_path / "day.tsv"
  done = subprocess.run(
      [sys.executable, "-W", "error::RuntimeWarning", "-m", "embedlib.data.criteo_synth",
       str(path), "--lines", "3", "--seed", "2"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert "RuntimeWarning" not in done.stderr
  CriteoSynth(seed=2).write(tmp_path / "oracle.tsv", 3)
  assert path.read_bytes() == (tmp_path / "oracle.tsv").read_bytes()
  assert len(path.read_text().splitlines()) == 3
