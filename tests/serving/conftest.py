"""One trained smoke run and its exported artifact, shared by the serving tests.

A 2-step run of ``configs/dlrm_criteo.py:smoke``'s DLRM with 4 of its 26
tables (``SERVED_TABLES``), exported by ``python -m train.export`` (the
command users run) for one CPU device; the tests restore the same model
in-process to compare with. Every export compiles its program over every
table, and the checks hold for any number of them. The Criteo reader reads
all 26 categorical columns, so the run draws the planted synthetic batches
instead; ``test_predict.py`` scores Criteo files with a 26-table artifact
of its own.
Under pytest-xdist the run and the artifact are made once per test session,
by the first worker that asks, and read by the others (``once_per_session``).
"""

import fcntl
import json
import os
import pathlib
import subprocess
import sys

import pytest

from configs import dlrm_criteo
from embedlib.training import export_lib, train_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def criteo_lines(n: int, start: int = 0) -> str:
  lines = []
  for i in range(start, start + n):
    dense = [str(i % 7), str(i % 3)] + [""] * 5 + [str(i % 11)] * 6
    cats = [format((i * 2654435761 + j * 97) % 4096, "x") for j in range(25)] + [""]
    lines.append("\t".join([str(i % 2)] + dense + cats) + "\n")
  return "".join(lines)


def run_module(*args, env=None, timeout=300):
  """``python -m args...`` from the checkout's root; the CompletedProcess."""
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


def once_per_session(tmp_path_factory, name: str, build):
  """``build()`` (JSON: paths as strings) made once per test session, for every xdist worker.

  Each pytest-xdist worker is a session of its own, which would make every
  session fixture again. The first worker to ask makes it while holding a
  lock in the directory the workers' temporary directories share, and
  writes what it returns there; the others wait on the lock and read it.
  What it made stays in that worker's directory, which lasts the session;
  the tests only read it. A build that fails writes nothing: the next
  worker to ask builds again. Without xdist, ``build()``.
  """
  if "PYTEST_XDIST_WORKER" not in os.environ:
    return build()
  shared = tmp_path_factory.getbasetemp().parent  # each worker's is a folder in it
  with open(shared / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    made = shared / f"{name}.json"
    if made.exists():
      return json.loads(made.read_text())
    result = build()
    made.write_text(json.dumps(result))
    return result


#: The served model's table sizes: its inputs are ``dense`` and ``f0 .. f3``.
SERVED_TABLES = (1_000,) * 4


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
  """The workdir of a finished 2-step smoke run: the Criteo smoke DLRM on ``SERVED_TABLES``."""

  def build():
    root = tmp_path_factory.mktemp("serving")
    config = dlrm_criteo.get_config("smoke")
    with config.unlocked():
      config.data.source, config.data.table_sizes = "synthetic", SERVED_TABLES
      config.num_train_steps, config.eval_every, config.checkpoint_every = 2, 2, 2
      config.eval_batches = 1
    train_lib.train_and_evaluate(config, str(root / "run"))
    return str(root / "run")

  return pathlib.Path(once_per_session(tmp_path_factory, "serving_trained", build))


@pytest.fixture(scope="session")
def artifact(trained, tmp_path_factory):
  """The one-device CPU artifact of ``trained``, written by ``python -m train.export``."""
  workdir = trained

  def build():
    out = workdir.parent / "artifact"
    done = run_module("train.export", f"--workdir={workdir}", f"--out={out}",
                      "--batch_size=16")
    assert done.returncode == 0, done.stderr[-3000:]
    return str(out)

  return pathlib.Path(once_per_session(tmp_path_factory, "serving_artifact", build))


@pytest.fixture(scope="session")
def restored(trained):
  """``(config, model, mesh)``: the run's model restored in-process on one device."""
  return export_lib.restore(str(trained), devices=1)


# -- a run with raw ids (dynamic tables) --------------------------------------------


def raw_criteo_lines(n: int, start: int = 0, distinct: int = 40) -> str:
  """Criteo lines whose categoricals are 60-bit values (in ``[2**59, 2**60)``), ``distinct`` per feature.

  Lines ``start .. start + n`` draw from ``distinct`` values per feature that
  depend on ``i % distinct``: lines with other ``start`` offsets and a larger
  ``distinct`` bring values a run on the first ones never saw.
  """
  lines = []
  for i in range(start, start + n):
    dense = [str(i % 7), str(i % 3)] + [""] * 5 + [str(i % 11)] * 6
    cats = [format(((i % distinct) * 0x9E3779B97F4A7C1 + j * 0x1F123BB5) % (1 << 59) + (1 << 59),
                   "x")
            for j in range(25)] + [""]  # the last one missing: MISSING_RAW
    lines.append("\t".join([str(i % 2)] + dense + cats) + "\n")
  return "".join(lines)


@pytest.fixture(scope="session")
def raw_trained(tmp_path_factory):
  """``(workdir, data file)`` of a ``configs/dlrm_criteo.py:smoke_raw`` run with learned defaults.

  Its maps are filled by two training-mode lookups of the file's raw ids
  (not by ``train_and_evaluate``: its train step takes minutes to compile
  for 26 dynamic tables), each table's learned default row is set to random
  values so that it differs from zeros, and the model is checkpointed in a
  workdir as a run's, for ``python -m train.export``.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from embedlib import checkpoint, dynamic  # pylint: disable=g-import-not-at-top
  from embedlib import data as data_lib  # pylint: disable=g-import-not-at-top
  from embedlib.training import setup  # pylint: disable=g-import-not-at-top

  root = tmp_path_factory.mktemp("serving_raw")
  data = root / "day.tsv"
  data.write_text(raw_criteo_lines(64))
  config = dlrm_criteo.get_config("smoke_raw")
  with config.unlocked():
    config.data.train_path, config.data.eval_holdout = str(data), 0.2
    config.model.dynamic.default = "learned"
  task = setup.task(config)
  spec = task.data_spec()
  mesh = export_lib.serving_mesh(config, 1)
  model, optimizer = setup.model_and_optimizer(config, task, spec, mesh)
  reader = data_lib.CriteoReader(str(data), spec, batch_size=1, raw_ids=True)
  rows = [data_lib.criteo.parse_line(line) for line in data.read_text().splitlines(True)]
  for part in (rows[:32], rows[32:]):
    batch = reader.assemble(part)
    model(batch["dense"], {k: dynamic.words(v) for k, v in batch["sparse"].items()})
  rng = np.random.default_rng(0)
  for table in model.embeddings.dynamic.values():
    table.default_row[...] = rng.normal(size=table.default_row.shape).astype(np.float32)
  workdir = root / "run"
  os.makedirs(workdir)
  (workdir / train_lib.CONFIG_FILE).write_text(config.to_json_best_effort(indent=2))
  ckpt = checkpoint.Checkpointer(str(workdir / "checkpoints"))
  try:
    ckpt.save(2, model, optimizer, {})
    ckpt.wait()
  finally:
    ckpt.close()
  return workdir, data


@pytest.fixture(scope="session")
def raw_artifact(raw_trained):
  """The one-device CPU artifact of ``raw_trained``, written by ``python -m train.export``."""
  workdir, _ = raw_trained
  out = workdir.parent / "artifact"
  done = run_module("train.export", f"--workdir={workdir}", f"--out={out}", "--batch_size=16")
  assert done.returncode == 0, done.stderr[-3000:]
  return out


@pytest.fixture(scope="session")
def raw_restored(raw_trained):
  """``(config, model, mesh)``: ``raw_trained``'s model restored in-process, in eval mode."""
  config, model, mesh = export_lib.restore(str(raw_trained[0]), devices=1)
  model.eval()
  return config, model, mesh


#: ``raw_small``'s tables: the second is multi-hot (bags of 3).
RAW_SMALL_BAGS = (1, 3, 1)


@pytest.fixture(scope="session")
def raw_small(tmp_path_factory):
  """``(config, model, mesh, artifact, seen)``: a 3-table raw-id DLRM, exported in-process.

  ``configs/quickstart.py:smoke`` with raw ids in 256-row dynamic tables
  (learned defaults, set to random values), the second feature multi-hot.
  Its maps hold ``seen[feature]``: 40 raw ids each, past ``2**63`` for
  the first feature and in ``[2**59, 2**60)`` for the others, admitted by
  eager training-mode lookups (3 tables compile in seconds, unlike the
  Criteo config's 26). The model is in eval mode.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  from configs import quickstart  # pylint: disable=g-import-not-at-top
  from embedlib import dynamic  # pylint: disable=g-import-not-at-top
  from embedlib.training import setup  # pylint: disable=g-import-not-at-top

  config = quickstart.get_config("smoke")
  with config.unlocked():
    config.data.table_sizes, config.data.bag_sizes = (256,) * 3, RAW_SMALL_BAGS
    config.data.raw_ids = True
    config.model.dynamic.update(capacity=256, bucket_size=32, default="learned")
  task = setup.task(config)
  spec = task.data_spec()
  mesh = export_lib.serving_mesh(config, 1)
  model, _ = setup.model_and_optimizer(config, task, spec, mesh)
  rng = np.random.default_rng(0)
  seen = {}
  for i, f in enumerate(spec.features):
    base = np.uint64(2**63) if i == 0 else np.uint64(2**59)
    seen[f.name] = base + rng.choice(2**58, size=40, replace=False).astype(np.uint64)
  batch = {f.name: np.resize(seen[f.name], (40,) if b == 1 else (40, b))
           for f, b in zip(spec.features, RAW_SMALL_BAGS)}
  model(rng.normal(size=(40, 13)).astype(np.float32),
        {k: dynamic.words(v) for k, v in batch.items()})
  for table in model.embeddings.dynamic.values():
    table.default_row[...] = rng.normal(size=table.default_row.shape).astype(np.float32)
  model.eval()
  out = tmp_path_factory.mktemp("serving_raw_small") / "artifact"
  export_lib.export(config, model, mesh, str(out), batch_size=16)
  return config, model, mesh, out, seen
