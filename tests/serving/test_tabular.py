"""A tabular run served: ``python -m train.export``, then ``python -m train.predict`` in a fresh process.

The run is the smoke DLRM on the Parquet click log (``tests.tabular_runs``,
the run ``tests/train/test_tabular.py`` checks). It scores new rows: users
the run never saw among its string ids, as Parquet and as CSV, with and
without the label column. What the artifact says equals, to the float32
bit, what the run's model restored in-process (``export_lib.restore``)
says of the same rows through ``eval_step``.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pyarrow.parquet as pq
import pytest

from embedlib import data as data_lib
from embedlib import dynamic, serving, tabular
from embedlib.serving import tabular as served_tabular
from embedlib.tabular import synth
from embedlib.training import export_lib, setup, steps, train_lib
from tests import tabular_runs
from tests.serving.conftest import ROOT, run_module

#: New rows to score: 150, a third of their users unknown to the run ("u50" .. "u79").
NEW_ROWS, NEW_USERS = 150, 80


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """``(logs, workdir)``: the smoke DLRM run on the Parquet log."""
  root = tmp_path_factory.mktemp("tabular_serving")
  logs = tabular_runs.parquet_log(root / "clicks")
  train_lib.train_and_evaluate(tabular_runs.config(logs), str(root / "run"))
  return logs, root / "run"


@pytest.fixture(scope="module")
def artifact(run):
  """The run exported by ``python -m train.export`` (one CPU device)."""
  _, workdir = run
  out = workdir.parent / "artifact"
  done = run_module("train.export", f"--workdir={workdir}", f"--out={out}")
  assert done.returncode == 0, done.stderr[-3000:]
  return out


@pytest.fixture(scope="module")
def new_rows(tmp_path_factory):
  """``{kind: path}``: the same new rows as Parquet (with and without labels) and as CSV."""
  root = tmp_path_factory.mktemp("new_rows")
  kw = dict(rows_total=NEW_ROWS, files=1, users=NEW_USERS, items=tabular_runs.ITEMS, seed=1)
  (labelled,) = synth.write(str(root / "parquet"), **kw)
  (csv,) = synth.write(str(root / "csv"), fmt="csv", **kw)
  unlabelled = root / "unlabelled.parquet"
  pq.write_table(pq.read_table(labelled).drop(["clicked"]), unlabelled)
  return {"parquet": labelled, "csv": csv, "unlabelled": str(unlabelled)}


def reference(workdir, path) -> np.ndarray:
  """Click probabilities of every row of ``path``: the run's model restored here, ``eval_step``."""
  config, model, mesh = export_lib.restore(str(workdir), devices=1)
  model.eval()
  task = setup.task(config).for_workdir(str(workdir))
  files = dataclasses.replace(task.prepared, files=tabular.find(str(path)))
  out = []
  with dynamic.frozen_maps(model):
    for batch in files.source("all", batch_size=config.batch_size, num_epochs=1,
                              pad_last=True):
      logits = steps.eval_step(model, data_lib.to_global_batch(task.featurize(batch), mesh),
                               task=task)
      out.append(np.asarray(jax.nn.sigmoid(logits))[batch["mask"] > 0])
  return np.concatenate(out)


def predict(artifact, path, out) -> np.ndarray:
  """``python -m train.predict`` of ``path`` in a fresh process: one float32 a row."""
  done = run_module("train.predict", f"--model={artifact}", f"--data={path}", f"--out={out}")
  assert done.returncode == 0, done.stderr[-3000:]
  assert f"wrote {NEW_ROWS} scores" in done.stderr
  return np.loadtxt(out, dtype=np.float32, ndmin=1)


def test_predict_in_a_fresh_process_scores_each_row_as_the_run_model(run, artifact, new_rows,
                                                                     tmp_path):
  """The rows without their label column: one probability a row, in order, bit for bit."""
  got = predict(artifact, new_rows["unlabelled"], tmp_path / "scores.txt")
  want = reference(run[1], new_rows["parquet"])
  assert got.shape == (NEW_ROWS,) and len(np.unique(want)) > NEW_ROWS // 2
  np.testing.assert_array_equal(got, want)


def test_files_whose_columns_changed_are_refused_naming_the_column(artifact, new_rows,
                                                                   tmp_path):
  changed = tmp_path / "changed.parquet"
  pq.write_table(pq.read_table(new_rows["parquet"]).drop(["price"]), changed)
  served = serving.load(artifact)
  with pytest.raises(tabular.DataError, match=r"changed\.parquet: no column 'price', which "
                     r"this run's schema reads \(as dense\)"):
    next(served_tabular.score_file(served, str(changed)))


@pytest.mark.slow
def test_predict_reads_csv_as_parquet(run, artifact, new_rows, tmp_path):
  """The same rows as CSV ('|' lists, empty nulls, the label column there): the same scores."""
  got = predict(artifact, new_rows["csv"], tmp_path / "scores.txt")
  np.testing.assert_array_equal(got, reference(run[1], new_rows["parquet"]))


# Blocks flax and embedlib's model and training code: what a server without them has.
_FRESH = """
import importlib.abc, json, sys
BLOCKED = ("flax", "optax", "orbax", "ml_collections", "configs", "train", "embedlib.models",
           "embedlib.training", "embedlib.collection", "embedlib.embed", "embedlib.dynamic")
class Blocker(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name in BLOCKED or name.startswith(tuple(b + "." for b in BLOCKED)):
      raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Blocker())
import numpy as np
import embedlib.serving
import embedlib.serving.tabular
served = embedlib.serving.load(sys.argv[1])
rows = [float(p) for out in embedlib.serving.tabular.score_file(served, sys.argv[2])
        for p in out["probability"]]
columns = json.loads(sys.argv[3])
named = [float(p) for p in embedlib.serving.tabular.score_columns(served, columns)["probability"]]
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "optax", "orbax"))
print(json.dumps({"rows": rows, "named": named, "loaded": loaded}))
"""


@pytest.mark.slow
def test_a_fresh_process_without_flax_scores_files_and_named_columns(run, artifact, new_rows):
  """``embedlib.serving.tabular`` on the CSV rows and on named columns, flax and training blocked.

  The named columns are the first rows' values as a client sends them
  (string user ids, lists, ``None`` for a null; no label).
  """
  table = pq.read_table(new_rows["parquet"]).slice(0, 7)
  columns = {name: table[name].to_pylist() for name in table.column_names if name != "clicked"}
  assert None in columns["price"] or None in columns["d0"] or None in columns["d1"], columns
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["PYTHONPATH"] = ROOT
  done = subprocess.run([sys.executable, "-c", _FRESH, str(artifact), new_rows["csv"],
                         json.dumps(columns)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert out["loaded"] == []
  want = reference(run[1], new_rows["parquet"])
  np.testing.assert_array_equal(np.float32(out["rows"]), want)
  np.testing.assert_array_equal(np.float32(out["named"]), want[:7])


@pytest.mark.slow
def test_a_run_with_a_dynamic_column_given_as_json_trains_and_serves(tmp_path, monkeypatch):
  """``--config.data.columns='{"user_id": {"ids": "dynamic"}}'``: raw string ids, hashed to 64 bits.

  The run trains on 8 devices, where each dynamic table holds whole buckets
  on every device; the artifact restores it on one.
  """
  logs = tabular_runs.parquet_log(tmp_path / "clicks")
  monkeypatch.chdir(ROOT)
  config = tabular_runs.parsed_config(
      ["train", f"--config=configs/tabular.py:smoke,{logs}", "--config.data.label=clicked",
       '--config.data.columns={"user_id": {"ids": "dynamic"}, "price": {"transform": "log1p"}}'],
      monkeypatch)
  workdir = tmp_path / "run"
  result = train_lib.train_and_evaluate(config, str(workdir))
  assert 0 <= result["test_auc"] <= 1
  schema, _ = tabular.saved.load(str(workdir))
  assert schema["user_id"].ids == "dynamic" and schema["price"].transform == "log1p"
  model, _ = setup.restore_model(config, str(workdir))
  resident = model.embeddings.dynamic["user_id"].resident()
  assert 0 < len(resident) <= tabular_runs.USERS  # the training rows' users, by their hash

  done = run_module("train.export", f"--workdir={workdir}", f"--out={tmp_path / 'artifact'}")
  assert done.returncode == 0, done.stderr[-3000:]
  manifest = json.loads((tmp_path / "artifact" / "manifest.json").read_text())
  assert manifest["dynamic_tables"]["user_id"]["resident"] == len(resident)
  path = tmp_path / "new.parquet"
  synth.write(str(tmp_path / "new"), rows_total=NEW_ROWS, files=1, users=NEW_USERS,
              items=tabular_runs.ITEMS, seed=1)
  (written,) = os.listdir(tmp_path / "new")
  os.rename(tmp_path / "new" / written, path)
  got = predict(tmp_path / "artifact", path, tmp_path / "scores.txt")
  np.testing.assert_array_equal(got, reference(workdir, path))
