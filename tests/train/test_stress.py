"""The stress tier: every config's smoke run with both cores kept busy, on 8 and 16 devices.

Each run is ``python -m train`` as a user starts it (jax's defaults: no
``XLA_FLAGS``, XLA's own collective timeouts, the pool ``import embedlib``
sizes), first on a quiet machine, then ``STRESS_REPEATS`` times (default 3)
while another process spins on every core; each loaded run must finish and
end with the quiet run's losses and eval, exactly. This is what stopped on
jax 0.10 (``embedlib.cpu_pool``): a collective queued behind devices that
all wait is more likely the busier the cores.

Slow (several minutes a config): one command runs it all,

    python3 -m pytest -m slow -s tests/train/test_stress.py

(``-s`` shows a line per run: config, devices, load average, seconds, result;
``STRESS_RECORD=path.jsonl`` also appends them to a file.) On the newest jax,
``/work/venv312/bin/python -m pytest ...`` the same with ``JAX_PLATFORMS=cpu``.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from embedlib.data.criteo_synth import CriteoSynth
from tests import xla_env
from tests.train.test_sequential import write_ml100k

pytestmark = pytest.mark.slow

REPEATS = int(os.environ.get("STRESS_REPEATS", "3"))
RAW = ("--config.num_train_steps=24", "--config.eval_every=12", "--config.checkpoint_every=12")
#: (name, config, overrides); "{criteo}" and "{movielens}" are the tier's data files.
RUNS = [
    ("quickstart", "configs/quickstart.py:smoke", ()),
    ("quickstart pipelined", "configs/quickstart.py:smoke", ("--config.pipeline=True",)),
    ("dlrm_criteo:smoke", "configs/dlrm_criteo.py:smoke", ("--config.data.train_path={criteo}",
                                                          "--config.data.eval_holdout=0.05")),
    ("dlrm_criteo:smoke pipelined", "configs/dlrm_criteo.py:smoke",
     ("--config.data.train_path={criteo}", "--config.data.eval_holdout=0.05",
      "--config.pipeline=True")),
    ("dlrm_criteo:smoke_raw", "configs/dlrm_criteo.py:smoke_raw",
     ("--config.data.train_path={criteo}", "--config.data.eval_holdout=0.05", *RAW)),
    ("dlrm_criteo:smoke_raw pipelined", "configs/dlrm_criteo.py:smoke_raw",
     ("--config.data.train_path={criteo}", "--config.data.eval_holdout=0.05", *RAW,
      "--config.pipeline=True")),
    ("movielens", "configs/movielens.py:smoke", ("--config.data.path={movielens}",)),
    ("two_tower", "configs/two_tower.py:smoke", ()),
    ("ranker", "configs/ranker.py:smoke", ()),
]
#: Per device count: 16 devices split a raw-id table's 8 buckets of 32 unevenly; 16 of 16 do.
DEVICE_OVERRIDES = {8: (), 16: ("--config.model.dynamic.bucket_size=16",)}

_SPIN = "import time\nwhile True:\n  time.time()"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  root = tmp_path_factory.mktemp("stress_data")
  CriteoSynth().write(root / "day.tsv", 4000)
  write_ml100k(root / "ml")
  return {"criteo": str(root / "day.tsv"), "movielens": str(root / "ml")}


def _env():
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=xla_env.ROOT)
  return env


def _result(workdir):
  """The run's losses and evals, as a quiet run must match them."""
  out = {}
  for name in ("train.jsonl", "eval.jsonl"):
    with open(os.path.join(workdir, name)) as f:
      out[name] = [{k: v for k, v in json.loads(line).items() if k != "examples_per_sec"}
                   for line in f]
  return out


def _run(config, overrides, devices, workdir, name, loaded):
  dynamic = "smoke_raw" in config or "raw_ids" in " ".join(overrides)
  args = [*overrides, *(DEVICE_OVERRIDES[devices] if dynamic else ())]
  spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(os.cpu_count() or 2)
              ] if loaded else []
  try:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "train", "--config", config, f"--workdir={workdir}",
         f"--cpu_devices={devices}", *args],
        cwd=xla_env.ROOT, env=_env(), capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
    load = os.getloadavg()[0]
  finally:
    for p in spinners:
      p.kill()
      p.wait()
  record = dict(run=name, devices=devices, loaded=loaded, load_1min=round(load, 1),
                seconds=round(seconds), returncode=proc.returncode,
                jax=_jax_version())
  return proc, record


def _jax_version():
  import jax  # pylint: disable=g-import-not-at-top
  return jax.__version__


def _note(record):
  print("stress:", json.dumps(record), flush=True)
  path = os.environ.get("STRESS_RECORD")
  if path:
    with open(path, "a") as f:
      f.write(json.dumps(record) + "\n")


@pytest.mark.parametrize("devices", [8, 16])
@pytest.mark.parametrize("name,config,overrides", RUNS, ids=[r[0] for r in RUNS])
def test_loaded_runs_finish_with_the_quiet_runs_result(tmp_path, data, name, config, overrides,
                                                        devices):
  overrides = [o.format(**data) for o in overrides]
  quiet, record = _run(config, overrides, devices, tmp_path / "quiet", name, loaded=False)
  _note(record)
  assert quiet.returncode == 0, quiet.stderr[-4000:]
  assert "may be stuck" not in quiet.stderr
  want = _result(tmp_path / "quiet")
  for i in range(REPEATS):
    workdir = tmp_path / f"loaded{i}"
    proc, record = _run(config, overrides, devices, workdir, name, loaded=True)
    record["equal"] = proc.returncode == 0 and _result(workdir) == want
    _note(record)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "may be stuck" not in proc.stderr
    assert _result(workdir) == want, name
