"""``embedlib.notebook``: the setup every notebook's first cell runs."""

import os
import subprocess
import sys

from embedlib import notebook
from tests import xla_env


def test_start_simulates_devices_before_jax_and_finds_the_checkout(tmp_path):
  """In a fresh process, as a notebook's kernel starts: no XLA_FLAGS, in a checkout's notebooks/."""
  checkout = tmp_path / "checkout"
  (checkout / "configs").mkdir(parents=True)
  (checkout / "notebooks").mkdir()
  env = {k: v for k, v in xla_env.subprocess_env().items() if k != "XLA_FLAGS"}
  env["PATH"] = str(tmp_path)  # no nvidia-smi: a runtime without a GPU
  code = ("import sys; from embedlib import notebook; notebook.start(); import jax; "
          "print(jax.device_count(), sys.path[0])")
  out = subprocess.run([sys.executable, "-c", code], cwd=checkout / "notebooks", env=env,
                       capture_output=True, text=True, check=True).stdout.split()
  assert out == [str(notebook.CPU_DEVICES), str(checkout)]


def test_smoke_switch_and_fresh_workdirs(monkeypatch):
  monkeypatch.delenv(notebook.SMOKE_ENV, raising=False)
  assert not notebook.smoke() and notebook.config_arg("full") == "full"
  monkeypatch.setenv(notebook.SMOKE_ENV, "1")
  assert notebook.smoke() and notebook.config_arg("full") == "smoke"
  a, b = notebook.fresh_workdir("x"), notebook.fresh_workdir("x")
  assert a != b and os.listdir(a) == [] and "embedlib_x_" in a
