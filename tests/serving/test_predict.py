"""``python -m train.predict``: one probability per input line, in order, equal to the artifact's."""

import numpy as np
import pytest

from embedlib import data as data_lib
from embedlib import serving
from train import predict as predict_lib

from tests.serving.conftest import criteo_lines, run_module


def test_predict_writes_one_score_per_line_in_order(artifact, tmp_path):
  # Lines with and without the label field (Criteo's test files have none), and a
  # last batch shorter than --batch_size.
  labelled = criteo_lines(45, start=1000)
  unlabelled = "".join(line.split("\t", 1)[1] for line in criteo_lines(6, start=2000).splitlines(True))
  path = tmp_path / "score.tsv"
  path.write_text(labelled + unlabelled)
  out = tmp_path / "scores.txt"
  done = run_module("train.predict", f"--model={artifact}", f"--data={path}", f"--out={out}",
                    "--batch_size=16", "--log_every=32")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "32 lines" in done.stderr and "wrote 51 scores" in done.stderr
  lines = out.read_text().splitlines()
  assert len(lines) == 51
  got = np.array([float(x) for x in lines], np.float32)
  # The artifact on the reader's own batches of the same lines, all at once.
  served = serving.load(artifact)
  spec = data_lib.criteo_spec([s["num_embeddings"] for s in served.manifest["inputs"][1:]])
  rows = [data_lib.criteo.parse_line(("" if i < 45 else "0\t") + line)
          for i, line in enumerate((labelled + unlabelled).splitlines(True))]
  batch = data_lib.CriteoReader(str(path), spec, batch_size=1).assemble(rows)
  want = served({"dense": batch["dense"], **batch["sparse"]})["probability"]
  np.testing.assert_array_equal(got, want)


def test_a_malformed_line_stops_naming_it(artifact, tmp_path):
  path = tmp_path / "bad.tsv"
  lines = criteo_lines(5).splitlines(True)
  lines[3] = "1\tnot-a-number" + "\t" * 38 + "\n"
  path.write_text("".join(lines))
  served = serving.load(artifact)
  reader = predict_lib._criteo_reader(served.manifest, str(path))  # pylint: disable=protected-access
  with pytest.raises(predict_lib.PredictError, match=r"bad.tsv:4: integer feature I1 is not an "
                                                     r"integer.*every line gets a score"):
    predict_lib.predict(served, reader, str(path), open(tmp_path / "o", "w"), 2, 100)
