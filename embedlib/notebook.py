"""What every notebook does first: devices, the checkout's ``configs/``, a line on the runtime.

And what the training notebooks share: the smoke switch (``smoke``,
``config_arg``) and a fresh workdir (``fresh_workdir``).

The notebooks (``notebooks/*.py``, paired with their ``.ipynb``) start::

    import os, subprocess, sys
    if "google.colab" in sys.modules:  # Colab: install embedlib (EMBEDLIB_PIP: another one)
      subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                      os.environ.get("EMBEDLIB_PIP", "embedlib")], check=True)
    from embedlib import notebook
    notebook.start()

Installing is the one step the notebook keeps: this module comes with the
package it installs. ``start`` must run before jax is imported (the
device count is read once, when jax starts), so this module imports
neither jax nor the rest of embedlib; ``runtime`` reads jax afterwards.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings

#: Simulated CPU devices on a runtime without a GPU: the layouts need a mesh.
CPU_DEVICES = 8
#: Set to "1" (the notebook tests do) to run the small config of a training notebook.
SMOKE_ENV = "EMBEDLIB_NOTEBOOK_SMOKE"


def start(devices: int = CPU_DEVICES) -> None:
  """Prepares a notebook's runtime: ``devices`` CPU devices without a GPU, the checkout's path.

  Without a GPU (no ``nvidia-smi``), JAX simulates ``devices`` CPU devices
  (``XLA_FLAGS``, unless it is set already): run it before jax is
  imported, which reads the count once. The checkout the notebook sits in
  (the folder above ``notebooks/``) goes first on ``sys.path``:
  ``configs/`` is read from it, not installed.
  """
  if "jax" in sys.modules and "XLA_FLAGS" not in os.environ:
    warnings.warn("jax is imported already, so its devices stay as they are; restart the "
                  "runtime and run notebook.start() first to simulate "
                  f"{devices} CPU devices.", stacklevel=2)
  if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={devices}")
  checkout = os.path.dirname(os.path.abspath(""))
  if os.path.isdir(os.path.join(checkout, "configs")) and checkout not in sys.path:
    sys.path.insert(0, checkout)


def smoke() -> bool:
  """Whether to run the small config (``EMBEDLIB_NOTEBOOK_SMOKE=1``: the notebook tests)."""
  return os.environ.get(SMOKE_ENV) == "1"


def fresh_workdir(name: str) -> str:
  """A new empty folder for a run of ``name``: a used one would resume from its checkpoint."""
  return tempfile.mkdtemp(prefix=f"embedlib_{name}_")


def config_arg(full: str | None = None) -> str | None:
  """A config file's ``get_config`` argument: ``"smoke"`` under ``smoke()``, else ``full``."""
  return "smoke" if smoke() else full


def runtime() -> str:
  """One line on the runtime: jax's version, the device count and the platform."""
  import jax  # after start(): pylint: disable=import-outside-toplevel

  return f"jax {jax.__version__}: {jax.device_count()} {jax.default_backend()} devices"
