"""One trained smoke run and its exported artifact, shared by the serving tests.

A 2-step ``configs/dlrm_criteo.py:smoke`` run on a 300-line Criteo-format
file, exported by ``python -m train.export`` (the command users run) for one
CPU device; the tests restore the same model in-process to compare with.
"""

import os
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


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
  """``(workdir, data file)`` of a finished 2-step Criteo smoke run."""
  root = tmp_path_factory.mktemp("serving")
  data = root / "day.tsv"
  data.write_text(criteo_lines(300))
  config = dlrm_criteo.get_config("smoke")
  with config.unlocked():
    config.data.train_path, config.data.eval_holdout = str(data), 0.2
    config.num_train_steps, config.eval_every, config.checkpoint_every = 2, 2, 2
    config.eval_batches = 1
  train_lib.train_and_evaluate(config, str(root / "run"))
  return root / "run", data


@pytest.fixture(scope="session")
def artifact(trained):
  """The one-device CPU artifact of ``trained``, written by ``python -m train.export``."""
  workdir, _ = trained
  out = workdir.parent / "artifact"
  done = run_module("train.export", f"--workdir={workdir}", f"--out={out}",
                    "--batch_size=16")
  assert done.returncode == 0, done.stderr[-3000:]
  return out


@pytest.fixture(scope="session")
def restored(trained):
  """``(config, model, mesh)``: the run's model restored in-process on one device."""
  return export_lib.restore(str(trained[0]), devices=1)
