"""A raw-id run end to end as a user starts it: ``smoke_raw`` for 200 steps on 8 CPU devices.

``python -m train`` in a subprocess with jax's defaults: no ``XLA_FLAGS`` (the
trainer's ``--cpu_devices`` asks for the 8 devices), so XLA:CPU's own
collective timeouts (20 s to warn, 40 s to abort) hold, not the suite's
raised ones (``tests/xla_env.py``), and the thread pool is the one
``import embedlib`` sizes (``embedlib.cpu_pool``). On jax 0.10 this run
stopped within a few steps, every device waiting in a collective, until XLA
aborted it; here it must train, evaluate and save at step 200.

The stress tier runs it with the other configs under load
(``tests/train/test_stress.py``).
"""

import json
import os
import subprocess
import sys

from embedlib.data.criteo_synth import CriteoSynth
from tests import xla_env

STEPS = 200


def test_smoke_raw_trains_200_steps_with_xlas_default_collective_timeouts(tmp_path):
  data = tmp_path / "day.tsv"
  # 200 steps of 32 samples, and the 5% held out for the eval.
  CriteoSynth().write(data, STEPS * 32 * 21 // 20 + 64)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=xla_env.ROOT)
  workdir = tmp_path / "run"
  result = subprocess.run(
      [sys.executable, "-m", "train", "--cpu_devices=8",
       "--config", "configs/dlrm_criteo.py:smoke_raw",
       f"--config.data.train_path={data}", "--config.data.eval_holdout=0.05",
       f"--config.num_train_steps={STEPS}", f"--config.eval_every={STEPS}",
       f"--config.checkpoint_every={STEPS}", "--config.eval_batches=2",
       f"--config.log_every={STEPS // 2}", f"--workdir={workdir}"],
      cwd=xla_env.ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-4000:]
  assert "1 processes, 8 devices" in result.stderr
  assert "may be stuck" not in result.stderr
  assert "final eval, at step 200" in result.stderr
  assert f"eval data: a held-out 5.0% of the lines of {data}" in result.stderr
  with open(workdir / "train.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [STEPS // 2, STEPS]
  assert os.path.isdir(workdir / "checkpoints" / str(STEPS))
  # The start-up plan lists the 26 dynamic tables.
  assert "EmbeddingCollection plan: 26 tables (26 dynamic)" in result.stderr
