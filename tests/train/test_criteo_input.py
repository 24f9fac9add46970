"""Criteo input options of ``python -m train``: the binary format, worker processes, and their errors."""

import gzip

import pytest

from embedlib.data import criteo_binary
from embedlib.training import setup, train_lib
from embedlib.training.writers import read_jsonl
from tests.train.test_train import _criteo_config, _criteo_lines


@pytest.fixture(scope="module")
def day(tmp_path_factory):
  """A 400-line TSV file, and its binary form hashed into the smoke config's tables."""
  tmp = tmp_path_factory.mktemp("day")
  path = tmp / "day_0.tsv"
  path.write_text(_criteo_lines(400))
  sizes = list(_criteo_config(path).data.table_sizes)
  criteo_binary.convert([str(path)], str(tmp / "day_0.bin"), table_sizes=sizes)
  return path, tmp / "day_0.bin"


@pytest.mark.parametrize("data, match", [
    (dict(format="binary"), r"config.data.train_path: 'TSV' is a file, and the binary Criteo "
     r"format is a directory .*format='tsv'"),
    (dict(format="binary", train_path="BIN", table_sizes=(64,) * 26),
     r"config.data.train_path / eval_path: .*day_0.bin holds ids hashed into table sizes "
     r"\[1000\] \* 26, and the run's are \[64\] \* 26: set config.data.table_sizes"),
    (dict(format="csv"), r"config.data.format: 'csv'; the criteo source reads one of "
     r"\('tsv', 'binary'\)"),
    (dict(format="binary", train_path="BIN", workers=2), r"config.data.workers: 2: .*the binary "
     r"format needs none"),
    (dict(workers=2, train_path="GZ"), r"config.data.workers: 2 worker processes read plain TSV "
     r"by byte ranges, and .*day_0.tsv.gz is gzip: gunzip it"),
])
def test_bad_input_settings_fail_at_start_up_naming_the_key(day, tmp_path, data, match):
  tsv, binary = day
  gz = tmp_path / "day_0.tsv.gz"
  gz.write_bytes(gzip.compress(tsv.read_bytes()))
  paths = {"TSV": str(tsv), "BIN": str(binary), "GZ": str(gz)}
  data = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in data.items()}
  config = _criteo_config(data.pop("train_path", "TSV").replace("TSV", str(tsv)),
                          eval_holdout=0.2, **data)
  with pytest.raises(setup.ConfigError, match=match.replace("'TSV'", f"'{tsv}'")):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def _last(workdir):
  train = {k: v for k, v in read_jsonl(workdir / "train.jsonl")[-1].items()
           if k != "examples_per_sec"}
  return train, read_jsonl(workdir / "eval.jsonl")[-1]


@pytest.mark.slow
def test_binary_and_worker_runs_train_as_the_tsv_run_and_resume_exactly(day, tmp_path):
  tsv, binary = day
  def run(workdir, steps, **data):
    config = _criteo_config(data.pop("path", tsv), eval_holdout=0.2, **data)
    with config.unlocked():
      config.num_train_steps = steps
    train_lib.train_and_evaluate(config, str(tmp_path / workdir))

  run("tsv", 4)
  run("binary", 2, path=binary, format="binary")
  run("binary", 4, path=binary, format="binary")  # resumed after step 2
  run("workers", 2, workers=2)
  run("workers", 4, workers=2)  # resumed after step 2, its workers started again
  expected = _last(tmp_path / "tsv")
  assert expected[0]["step"] == 4 and expected[1]["step"] == 4
  assert _last(tmp_path / "binary") == expected
  assert _last(tmp_path / "workers") == expected


def test_input_settings_of_the_criteo_source_are_refused_elsewhere(tmp_path):
  from configs import quickstart  # pylint: disable=g-import-not-at-top
  config = quickstart.get_config("smoke")
  with config.unlocked():
    config.data.workers = 2
  with pytest.raises(setup.ConfigError, match=r"config.data.workers: the synthetic source makes "
                     r"its batches in this process; .* leave them at 'tsv' and 0"):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
