"""``python -m train --config configs/tabular.py:smoke,PATH`` on a team's own files, end to end.

Each run is ``train_lib.train_and_evaluate`` of ``configs.tabular.get_config("smoke," +
path)`` with ``--config.data.label`` and the overrides a test names, as
``python -m train`` calls it: a Parquet directory with string user ids, a
list column and dense nulls (DLRM), a CSV file with '|' lists and two
labels (DCN-v2), and RecBole atomic files with their side columns (two
towers and the ranker), all written by ``tests.tabular_runs``.

The fast tests build no model: bad configs and changed files are refused
while the data is read, before anything is compiled. The trained runs are
slow; the Parquet run (``straight``) is also the uninterrupted run that a
run stopped mid-file and resumed is compared with, bit for bit.
"""

import json
import os
import shutil
import signal

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx

from embedlib import checkpoint, optim, tabular
from embedlib.tabular import saved as saved_lib
from embedlib.tabular import schema as schema_lib
from embedlib.training import early_stop, setup, train_lib
from embedlib.training.tasks import ConfigError
from embedlib.training.writers import read_jsonl
from tests import tabular_runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CTR = {"auc", "logloss"}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
  """The Parquet log (a directory of two files), read by every test here."""
  return tabular_runs.parquet_log(tmp_path_factory.mktemp("logs") / "clicks")


@pytest.fixture(scope="module")
def straight(logs, tmp_path_factory):
  """``(workdir, result, messages)`` of the uninterrupted 6-step DLRM run on ``logs``."""
  workdir = tmp_path_factory.mktemp("straight") / "run"
  with tabular_runs.Messages() as messages:
    result = train_lib.train_and_evaluate(tabular_runs.config(logs), str(workdir))
  return workdir, result, messages.lines


def _restored(config, workdir, directory: str = "checkpoints"):
  """``(model, mesh)`` at the newest checkpoint in ``workdir/directory`` (``best``: the best eval's)."""
  model, mesh = setup.restore_model(config, str(workdir))
  ckpt = checkpoint.Checkpointer(str(workdir / directory))
  try:
    ckpt.restore_model(model, tuple(k for k, _ in optim.sparse_tables(model)))
  finally:
    ckpt.close()
  return model, mesh


def _weights(config, workdir, directory: str = "checkpoints") -> dict:
  """Every array of the model in the newest checkpoint of ``workdir/directory``, by its path."""
  model, _ = _restored(config, workdir, directory)
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model))}


def _assert_same_weights(got: dict, want: dict):
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _no_model(monkeypatch):
  """Makes building a model fail: a finished run must return without one."""
  def build(*args, **kwargs):
    raise AssertionError("a finished run built its model")
  monkeypatch.setattr(setup, "model_and_optimizer", build)


def _files(workdir) -> dict:
  """``{relative path: (size, mtime)}`` of every file under ``workdir``."""
  out = {}
  for where, _, names in os.walk(workdir):
    for name in names:
      path = os.path.join(where, name)
      out[os.path.relpath(path, workdir)] = (os.path.getsize(path), os.path.getmtime(path))
  return out


# -- the Parquet run -------------------------------------------------------------------


@pytest.mark.slow
def test_parquet_run_writes_its_metrics_schema_and_statistics(logs, straight, monkeypatch):
  workdir, result, messages = straight
  evals = read_jsonl(workdir / "eval.jsonl")
  assert [e["step"] for e in evals] == [3, 6]
  assert set(evals[0]) == {"step"} | CTR
  # The test rows, once, at the end, with the best eval's weights (early_stopping=3).
  assert set(evals[-1]) == {"step", "best_step"} | CTR | {f"test_{k}" for k in CTR}
  assert evals[-1]["best_step"] in (3, 6) and type(evals[-1]["best_step"]) is int
  assert result == evals[-1]
  for e in evals:
    assert 0 <= e["auc"] <= 1 and e["logloss"] > 0 and 0 <= evals[-1]["test_auc"] <= 1

  # The schema and statistics in the workdir are what the run printed and read.
  schema, statistics = saved_lib.load(str(workdir))
  (printed,) = [m for m in messages if m.startswith("data: ")]
  assert schema.describe() in printed
  assert f"{statistics['rows']} training rows" in printed
  assert schema["user_id"].dtype == "string" and schema["user_id"].role == "user_id"
  assert schema["categories"].role == "categorical_list" and schema["categories"].max_len == 4
  assert schema["price"].role == "dense" and schema["clicked"].role == "label"
  assert statistics["columns"]["price"]["nulls"] > 0  # the log's nulls, read as the mean
  again = tabular.prepare(logs, tabular.Hints(labels=("clicked",)),
                          split=tabular.Split("hash", eval_fraction=0.1, test_fraction=0.1))
  assert json.loads(again.statistics) == statistics and again.schema == schema

  # A rerun of the finished workdir returns its last eval without building a model.
  _no_model(monkeypatch)
  before = _files(workdir)
  assert train_lib.train_and_evaluate(tabular_runs.config(logs), str(workdir)) == evals[-1]
  assert _files(workdir) == before


# -- resume ------------------------------------------------------------------------------


def _sigterm_after(monkeypatch, step: int):
  """Sends this process SIGTERM after training step ``step``, as a preemption would."""
  agreed = train_lib._stop_agreed  # pylint: disable=protected-access

  def stop_agreed(stop, at, log_every):
    if at == step:
      os.kill(os.getpid(), signal.SIGTERM)
    return agreed(stop, at, log_every)

  monkeypatch.setattr(train_lib, "_stop_agreed", stop_agreed)


@pytest.mark.slow
def test_a_run_stopped_mid_file_resumes_exactly_with_or_without_workers(logs, straight,
                                                                          tmp_path, monkeypatch):
  """SIGTERM after step 4 (mid-chunk: 64-row batches of 128-row groups), then the rest.

  The checkpoint holds the source's position, so the resumed run reads the
  batches the uninterrupted one did: the same evals and weights, bit for
  bit, whether the rows are read here or by 2 grain worker processes.
  """
  workdir, _, _ = straight
  stopped = tmp_path / "stopped"
  with monkeypatch.context() as m:
    _sigterm_after(m, 4)
    train_lib.train_and_evaluate(tabular_runs.config(logs), str(stopped))
  assert sorted(os.listdir(stopped / "checkpoints"), key=int) == ["3", "4"]
  assert [e["step"] for e in read_jsonl(stopped / "eval.jsonl")] == [3]
  with_workers = tmp_path / "with_workers"
  shutil.copytree(stopped, with_workers)

  want = read_jsonl(workdir / "eval.jsonl")
  weights = {d: _weights(tabular_runs.config(logs), workdir, d) for d in ("checkpoints", "best")}
  for run, workers in ((stopped, 0), (with_workers, 2)):
    config = tabular_runs.config(logs, **{"data.workers": workers})
    train_lib.train_and_evaluate(config, str(run))
    assert read_jsonl(run / "eval.jsonl") == want, workers
    for directory, trained in weights.items():
      _assert_same_weights(_weights(config, run, directory), trained)
    steps = [r["step"] for r in read_jsonl(run / "train.jsonl")]
    assert steps == [2, 4, 6], steps  # nothing lost or repeated


@pytest.mark.slow
def test_a_run_stopped_by_num_train_steps_trains_on_to_the_same_end(logs, tmp_path):
  """A run ended at a step that is not its best eval's, raised to more steps, trains on.

  Its end scored the test rows with the best eval's weights (early_stopping=3);
  its checkpoint there keeps the trained ones, so the rest of the run is the
  uninterrupted run's, bit for bit.
  """
  # Long enough for an eval below an earlier one: the first six rise on this log.
  steps = 10
  config = lambda n: tabular_runs.config(logs, num_train_steps=n, eval_every=1)
  straight = tmp_path / "straight"
  train_lib.train_and_evaluate(config(steps), str(straight))
  want = read_jsonl(straight / "eval.jsonl")
  aucs = [e["auc"] for e in want]
  # Not its best, and not the last: the raised run must train on past it.
  end = next((k for k in range(2, steps) if aucs[k - 1] < max(aucs[:k - 1])), None)
  assert end is not None, f"no eval below an earlier one in {aucs}: raise `steps`"
  run = tmp_path / "run"
  first = train_lib.train_and_evaluate(config(end), str(run))
  assert first["step"] == end and first["best_step"] < end and "test_auc" in first
  train_lib.train_and_evaluate(config(steps), str(run))
  got = read_jsonl(run / "eval.jsonl")
  assert got[-1] == want[-1]
  assert [{k: e[k] for k in CTR} for e in got] == [{k: e[k] for k in CTR} for e in want]
  for directory in ("checkpoints", "best"):
    _assert_same_weights(_weights(config(steps), run, directory),
                         _weights(config(steps), straight, directory))


# -- early stopping ------------------------------------------------------------------------


@pytest.mark.slow
def test_early_stopping_stops_and_scores_the_test_rows_with_the_best_weights(logs, tmp_path,
                                                                             monkeypatch):
  """An eval every step, patience 1: it stops at the first eval no better than the one before."""
  config = tabular_runs.config(logs, num_train_steps=40, eval_every=1, early_stopping=1)
  workdir = tmp_path / "run"
  result = train_lib.train_and_evaluate(config, str(workdir))
  evals = read_jsonl(workdir / "eval.jsonl")
  aucs = [e["auc"] for e in evals]
  stop = next(i for i in range(1, len(aucs)) if aucs[i] <= aucs[i - 1])
  assert len(evals) == stop + 1 < 40, aucs
  stop_step, best_step = evals[stop]["step"], evals[stop - 1]["step"]
  assert json.loads((workdir / early_stop.STOPPED_FILE).read_text()) == {
      "step": stop_step, "best_step": best_step, "metric": "auc", "best": aucs[stop - 1]}
  assert result == evals[-1] and evals[-1]["best_step"] == best_step
  assert all(not k.startswith("test_") for e in evals[:-1] for k in e)
  assert str(stop_step) in os.listdir(workdir / "checkpoints")

  # The run's model (what an export restores) has the best eval's weights: they score
  # the eval rows as that eval did, and the test rows as the run reported. Its last
  # checkpoint keeps the weights it stopped with.
  task = setup.task(config).for_workdir(str(workdir))
  _, eval_source = setup.sources(config, task, task.data_spec())
  model, mesh = setup.restore_model(config, str(workdir))
  start = eval_source.get_state()
  score = lambda m: train_lib.evaluate(m, eval_source, start, mesh, config.eval_batches, task)
  assert score(model)["auc"] == aucs[stop - 1] != aucs[stop]
  assert task.test(model, eval_source, mesh) == {
      k: v for k, v in evals[-1].items() if k.startswith("test_")}
  assert score(_restored(config, workdir)[0])["auc"] == aucs[stop]

  # Stopped early, it is finished: a rerun returns at once.
  _no_model(monkeypatch)
  assert train_lib.train_and_evaluate(config, str(workdir)) == evals[-1]


# -- other files and models -------------------------------------------------------------------


@pytest.mark.slow
def test_csv_with_list_columns_and_two_labels_trains_dcn_v2_with_an_auc_each(tmp_path):
  path = tabular_runs.csv_log(tmp_path / "csv", second_label=True)
  config = tabular_runs.config(path, label="clicked,bought", **{"model.name": "dcn_v2"})
  result = train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  per_label = {f"{m}_{label}" for m in CTR for label in ("clicked", "bought")}
  evals = read_jsonl(tmp_path / "run" / "eval.jsonl")
  assert set(evals[0]) == {"step", "auc"} | per_label
  assert set(result) == {"step", "auc", "best_step"} | per_label | {
      f"test_{k}" for k in per_label | {"auc"}}
  assert result["auc"] == pytest.approx((result["auc_clicked"] + result["auc_bought"]) / 2)
  schema, _ = saved_lib.load(str(tmp_path / "run"))
  assert schema.labels() == ("clicked", "bought")
  assert schema["categories"].role == "categorical_list" and schema["categories"].dtype == "int"


@pytest.fixture(scope="module")
def recbole(tmp_path_factory):
  return tabular_runs.recbole_dataset(tmp_path_factory.mktemp("recbole") / "tiny")


@pytest.mark.slow
@pytest.mark.parametrize("model, metrics", [
    ("two_tower", {"recall@5", "recall@10"}),  # of 40 movies
    ("ranker", CTR),
])
def test_recbole_files_train_with_their_side_columns(recbole, model, metrics, tmp_path):
  """Ratings of 4 and 5 are the clicks (the two towers' positive rows)."""
  config = tabular_runs.config(recbole, label="rating", **{
      "data.label_threshold": 4.0, "model.name": model, "task.recall_ks": (5, 10)})
  result = train_lib.train_and_evaluate(config, str(tmp_path))
  assert set(result) == {"step", "best_step"} | metrics | {f"test_{k}" for k in metrics}
  assert all(0 <= result[k] <= 1 for k in metrics)
  schema, _ = saved_lib.load(str(tmp_path))
  entities = {c.name: (c.role, c.entity) for c in schema.columns}
  assert entities["age"] == entities["occupation"] == ("categorical", "user")
  assert entities["class"] == entities["movie_title"] == ("categorical_list", "item")
  assert entities["release_year"] == ("categorical", "item")
  assert entities["rating"] == ("label", "")


# -- refused before anything is built -------------------------------------------------------


def _empty_parquet(root):
  path = root / "empty.parquet"
  pq.write_table(pa.table({"clicked": pa.array([], pa.int64())}), path)
  return path


def _header_only(root):
  (root / "header.csv").write_text("user_id,item_id,clicked\n")
  return root / "header.csv"


def _empty_file(root):
  (root / "empty.csv").write_text("")
  return root / "empty.csv"


BAD = {
    "no label": (None, {"data.label": ""},
                 r"config\.data\.label: config\.model\.name='dlrm' predicts a label"),
    "a label of strings": (None, {"data.label": "device"},
                           r"config\.data\.label: column 'device' .* holds strings"),
    "an unknown label": (None, {"data.label": "clickd"},
                         r"config\.data\.label: .* has no column 'clickd'; its columns are"),
    "an unknown column": (None, {"data.columns": {"pricee": {"transform": "log1p"}}},
                          r"config\.data\.columns\.pricee: .* has no column 'pricee'"),
    "a column's bad value": (None, {"data.columns": {"price": {"transform": "log2"}}},
                             r"config\.data\.columns\.price: column 'price': transform='log2'"),
    "columns not JSON": (None, {"data.columns": '{"price": '},
                         r"config\.data\.columns: .* is not JSON"),
    "an unknown dense column": (None, {"data.dense": "hour,hourr"},
                                r"config\.data\.dense: .* has no column 'hourr'"),
    "an unknown ignored column": (None, {"data.ignore": "notes"},
                                  r"config\.data\.ignore: .* has no column 'notes'"),
    "an eval fraction past 1": (None, {"data.eval_fraction": 1.5},
                                r"config\.data\.eval_fraction=1\.5: a fraction in \[0, 1\)"),
    "no rows left to train": (None, {"data.eval_fraction": 0.6, "data.test_fraction": 0.5},
                              r"config\.data\.eval_fraction=0\.6, test_fraction=0\.5: .* "
                              r"both together < 1"),
    "a path that doesn't exist": (lambda root: root / "nope.parquet", {},
                                  r"config\.data\.path: .*nope\.parquet does not exist"),
    "an empty file": (_empty_file, {}, r"config\.data\.path: .*empty\.csv is empty"),
    "a header and no rows": (_header_only, {},
                             r"config\.data\.path: .*header\.csv holds no rows"),
    "an empty Parquet file": (_empty_parquet, {},
                              r"config\.data\.path: .*empty\.parquet holds no rows"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_config_fails_before_the_workdir_naming_its_key(case, logs, tmp_path):
  make_path, overrides, message = BAD[case]
  path = logs if make_path is None else make_path(tmp_path)
  workdir = tmp_path / "run"
  with pytest.raises(ConfigError, match=message):
    train_lib.train_and_evaluate(tabular_runs.config(path, **overrides), str(workdir))
  assert not workdir.exists()


def _parquet(change):
  """A copy of the Parquet log, and what rewrites its files as ``change(table)``."""
  def make(root, logs):
    path = str(root / "log")
    shutil.copytree(logs, path)
    return path, lambda: tabular_runs.rewrite_parquet(logs, path, change), {}
  return make


def _item_ids_as_strings(table):
  at = table.schema.get_field_index("item_id")
  return table.set_column(at, "item_id", pa.array([f"i{x}" for x in table["item_id"].to_pylist()]))


@pytest.mark.parametrize("key", ["eval_path", "test_path"])
def test_a_bad_value_in_an_eval_or_test_file_fails_before_the_workdir(key, tmp_path):
  """The training file's rows are read for their statistics; the other files' are read too."""
  lines = open(tabular_runs.csv_log(tmp_path / "csv"), encoding="utf-8").read().splitlines()
  header, rows = lines[:1], lines[1:]
  (tmp_path / "train.csv").write_text("\n".join(header + rows[:400]) + "\n")
  (tmp_path / "good.csv").write_text("\n".join(header + rows[400:]) + "\n")
  at = header[0].split(",").index("price")
  bad = rows[549].split(",")
  bad[at] = "n/a"
  rows[549] = ",".join(bad)  # line 151 of the file: past the lines checked up front
  (tmp_path / "bad.csv").write_text("\n".join(header + rows[400:]) + "\n")
  files = {"eval_path": tmp_path / "good.csv", "test_path": tmp_path / "good.csv",
           key: tmp_path / "bad.csv"}
  config = tabular_runs.config(tmp_path / "train.csv",
                               **{f"data.{k}": str(v) for k, v in files.items()})
  with pytest.raises(ConfigError, match=rf"config\.data\.{key}: .*bad\.csv:151: column "
                     r"'price' holds 'n/a', which is not a number"):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def _csv(root, logs):
  """The CSV log, and what writes its int item ids as strings ('i7')."""
  del logs
  path = tabular_runs.csv_log(root / "csv")

  def change():
    lines = open(path, encoding="utf-8").read().splitlines()
    at = lines[0].split(",").index("item_id")
    out = [lines[0]]
    for line in lines[1:]:
      fields = line.split(",")
      fields[at] = "i" + fields[at]
      out.append(",".join(fields))
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n".join(out) + "\n")
  return path, change, {}


def _recbole(root, logs):
  """The RecBole dataset, and what types its item genres (a token list) as one token."""
  del logs
  inter = tabular_runs.recbole_dataset(root / "tiny")
  item = inter[:-len(".inter")] + ".item"
  text = open(item, encoding="utf-8").read()

  def change():
    with open(item, "w", encoding="utf-8") as f:
      f.write(text.replace("class:token_seq", "class:token", 1))
  ranker = {"data.label": "rating", "data.label_threshold": 4.0, "model.name": "ranker"}
  return inter, change, ranker


CHANGED = {
    "parquet, a column dropped": (_parquet(lambda t: t.drop(["price"])), "price",
                                  "no column 'price', which this run's schema reads"),
    "parquet, int ids now strings": (_parquet(_item_ids_as_strings), "item_id",
                                     "column 'item_id' holds string values"),
    "csv, int ids now strings": (_csv, "item_id", r"\.csv:2: column 'item_id' holds 'i"),
    "recbole, a token list now a token": (_recbole, "class",
                                          "column 'class' is categorical of string there"),
}


@pytest.mark.parametrize("case", list(CHANGED))
def test_a_resumed_run_refuses_files_whose_columns_changed(case, logs, tmp_path):
  """The run's schema is saved when it starts; the files are checked against it on resume."""
  make, column, message = CHANGED[case]
  path, change, overrides = make(tmp_path, logs)
  # A run's start: its files read, its schema and statistics saved in its workdir.
  workdir = tmp_path / "run"
  workdir.mkdir()
  setup.task(tabular_runs.config(path, **overrides)).for_workdir(str(workdir)).save(
      str(workdir))
  before = _files(workdir)
  change()
  with pytest.raises(ConfigError, match=message) as raised:
    train_lib.train_and_evaluate(tabular_runs.config(path, **overrides), str(workdir))
  assert f"'{column}'" in str(raised.value)
  assert _files(workdir) == before


def test_columns_given_as_json_on_the_command_line(logs, tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  columns = ('{"price": {"transform": "log1p", "default": null}, '
             '"user_id": {"ids": "dynamic"}, "device": {"ids": "hashed", "num_embeddings": 16}}')
  config = tabular_runs.parsed_config(
      ["train", f"--config=configs/tabular.py:smoke,{logs}", "--config.data.label=clicked",
       f"--config.data.columns={columns}"], monkeypatch)
  schema = setup.task(config).for_workdir(str(tmp_path)).prepared.schema
  assert schema["price"].transform == "log1p" and schema["price"].default is None
  assert schema["user_id"].ids == schema_lib.DYNAMIC
  assert schema["device"].ids == schema_lib.HASHED and schema["device"].num_embeddings == 16
  # A dynamic table holds whole buckets on each of the run's 8 devices.
  assert schema["user_id"].num_embeddings == 8 * 128
