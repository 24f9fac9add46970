"""Two processes x 4 CPU devices train like one process x 8 devices.

``jax.distributed`` on 127.0.0.1 (gloo collectives on CPU); each process reads
its own slice of every global batch. Tolerance: the losses and metrics agree
to 1e-4 relative, since cross-process all-reduces add in another order.
"""

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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _command(workdir, *extra):
  return [sys.executable, "-m", "train", "--config", "configs/quickstart.py:smoke",
          f"--workdir={workdir}", *extra]


def _env(devices):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return env


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
  single = tmp_path / "single"
  subprocess.run(_command(single), cwd=ROOT, env=_env(8), check=True,
                 capture_output=True, timeout=600)
  multi = tmp_path / "multi"
  port = _free_port()
  procs = [
      subprocess.Popen(
          _command(multi, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                   f"--process_id={i}"),
          cwd=ROOT, env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)
  ]
  outputs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]
  assert "2 processes, 8 devices" in outputs[0][1]
  for name, keys in (("train.jsonl", ["loss"]), ("eval.jsonl", ["auc", "logloss"])):
    one, two = read_jsonl(single / name), read_jsonl(multi / name)
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for key in keys:
      np.testing.assert_allclose([r[key] for r in two], [r[key] for r in one], rtol=1e-4)

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
