"""Two processes x 4 CPU devices train like one process x 8 devices.

``jax.distributed`` on 127.0.0.1 (gloo collectives on CPU); each process reads
its own slice of every global batch. Tolerance: the losses and metrics agree
to 1e-4 relative, since cross-process all-reduces add in another order.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from configs import quickstart
from embedlib import checkpoint
from embedlib.training import setup
from embedlib.training.writers import read_jsonl
from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _command(workdir, *extra, config="configs/quickstart.py:smoke"):
  return [sys.executable, "-m", "train", "--config", config, f"--workdir={workdir}", *extra]


def _env(devices):
  return xla_env.subprocess_env(devices)


#: What each run's train.jsonl and eval.jsonl must agree on (quickstart's).
CTR_KEYS = (("train.jsonl", ["loss"]), ("eval.jsonl", ["auc", "logloss"]))


def _one_and_two_processes(tmp_path, *extra, config="configs/quickstart.py:smoke",
                           keys=CTR_KEYS):
  """Workdirs of the same run in one process of 8 devices and two of 4.

  ``keys``: ``(file, [key])`` pairs whose records agree to 1e-4 relative.
  """
  single = tmp_path / "single"
  subprocess.run(_command(single, *extra, config=config), cwd=ROOT, env=_env(8), check=True,
                 capture_output=True, timeout=600)
  multi = tmp_path / "multi"
  port = _free_port()
  procs = [
      subprocess.Popen(
          _command(multi, *extra, f"--coordinator_address=127.0.0.1:{port}",
                   "--num_processes=2", f"--process_id={i}", config=config),
          cwd=ROOT, env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)
  ]
  outputs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]
  assert "2 processes, 8 devices" in outputs[0][1]
  for name, names in keys:
    one, two = read_jsonl(single / name), read_jsonl(multi / name)
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for key in names:
      np.testing.assert_allclose([r[key] for r in two], [r[key] for r in one], rtol=1e-4,
                                 err_msg=f"{name}: {key}")
  return single, multi


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  # With auto dedup planned for skews fitted to the first batch: the two
  # processes fit their slices and agree with the one process's fit.
  single, multi = _one_and_two_processes(
      tmp_path, "--config.model.id_skew=fit", "--config.model.num_unique=auto")
  fitted = [json.loads((w / setup.ID_SKEW_FILE).read_text()) for w in (single, multi)]
  assert fitted[0] == fitted[1] and max(fitted[0].values()) > 0, fitted

  # Each process wrote its own shards of the tables; together they restore
  # (here, onto this process's 8 devices) to the one-process run's tables.
  config = quickstart.get_config("smoke")
  task = setup.task(config)
  mesh, spec = setup.make_mesh(config), task.data_spec()
  tables = []
  for workdir in (single, multi):
    model, optimizer = setup.model_and_optimizer(config, task, spec, mesh)
    ckpt = checkpoint.Checkpointer(str(workdir / "checkpoints"))
    assert ckpt.restore_newest(model, optimizer)[0] == 6
    ckpt.close()
    tables.append({k: np.asarray(t.logical_table()) for k, t in model.embeddings.tables.items()})
  for key in tables[0]:
    np.testing.assert_allclose(tables[1][key], tables[0][key], rtol=1e-4, atol=1e-6)


#: Dynamic tables far smaller than the ids seen (quickstart's smoke with raw ids).
DYNAMIC = {"capacity": 64, "bucket_size": 8, "admit_after": 2, "eviction": "lfu"}


@pytest.mark.slow
def test_raw_ids_in_two_processes_match_one(tmp_path):
  """Dynamic tables: each process routes its ids to the maps' owners over gloo.

  The maps are functions of the ids alone, so they are equal exactly (every
  resident id in the same row, the same scores and clocks); the rows to
  the losses' tolerance.
  """
  single, multi = _one_and_two_processes(
      tmp_path, "--config.data.raw_ids=True",
      *(f"--config.model.dynamic.{k}={v}" for k, v in DYNAMIC.items()))
  config = quickstart.get_config("smoke")
  with config.unlocked():
    config.data.raw_ids = True
    config.model.dynamic.update(DYNAMIC)
  one, _ = setup.restore_model(config, str(single))
  two, _ = setup.restore_model(config, str(multi))
  tables = one.embeddings.dynamic
  assert len(tables) == 8
  for name, a in tables.items():
    b = two.embeddings.dynamic[name]
    assert int(a.clock[...]) == int(b.clock[...]) == config.num_train_steps, name
    assert a.resident() == b.resident() and a.resident(), name
    for var in ("score", "placed_at"):
      np.testing.assert_array_equal(np.asarray(getattr(b, var)[...]),
                                    np.asarray(getattr(a, var)[...]), err_msg=name)
    np.testing.assert_allclose(np.asarray(b.rows.embedding[...]),
                               np.asarray(a.rows.embedding[...]), rtol=1e-4, atol=1e-6)
