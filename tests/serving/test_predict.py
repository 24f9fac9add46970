"""``python -m train.predict``: one probability per input line, in order, equal to the artifact's.

The artifact is a Criteo run's: ``configs/dlrm_criteo.py:smoke``'s 26 tables,
one for each categorical column of the file (the shared serving model has 4,
and the Criteo reader reads all 26). Scoring needs no training, so the model
is exported as set up, in-process.
"""

import numpy as np
import pytest

from configs import dlrm_criteo
from embedlib import data as data_lib
from embedlib import serving
from embedlib.training import export_lib, setup
from train import predict as predict_lib

from tests.serving.conftest import criteo_lines, run_module


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
  """The one-device CPU artifact of a ``configs/dlrm_criteo.py:smoke`` model on a Criteo file."""
  root = tmp_path_factory.mktemp("criteo_serving")
  data = root / "day.tsv"
  data.write_text(criteo_lines(300))
  config = dlrm_criteo.get_config("smoke")
  with config.unlocked():
    config.data.train_path, config.data.eval_holdout = str(data), 0.2
  task = setup.task(config)
  mesh = export_lib.serving_mesh(config, 1)
  model, _ = setup.model_and_optimizer(config, task, task.data_spec(), mesh)
  export_lib.export(config, model, mesh, str(root / "artifact"), batch_size=16)
  return root / "artifact"


@pytest.fixture(scope="module")
def served(artifact):
  return serving.load(artifact)


def test_predict_writes_one_score_per_line_in_order(artifact, served, tmp_path):
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
  spec = data_lib.criteo_spec([s["num_embeddings"] for s in served.manifest["inputs"][1:]])
  rows = [data_lib.criteo.parse_line(("" if i < 45 else "0\t") + line)
          for i, line in enumerate((labelled + unlabelled).splitlines(True))]
  batch = data_lib.CriteoReader(str(path), spec, batch_size=1).assemble(rows)
  want = served({"dense": batch["dense"], **batch["sparse"]})["probability"]
  np.testing.assert_array_equal(got, want)


def test_a_malformed_line_stops_naming_it(served, tmp_path):
  path = tmp_path / "bad.tsv"
  lines = criteo_lines(5).splitlines(True)
  lines[3] = "1\tnot-a-number" + "\t" * 38 + "\n"
  path.write_text("".join(lines))
  reader = predict_lib._criteo_reader(served.manifest, str(path))  # pylint: disable=protected-access
  with pytest.raises(predict_lib.PredictError, match=r"bad.tsv:4: integer feature I1 is not an "
                                                     r"integer.*every line gets a score"):
    predict_lib.predict(served, reader, str(path), open(tmp_path / "o", "w"), 2, 100)
