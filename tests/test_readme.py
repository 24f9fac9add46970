"""Every fenced Python block of README.md runs as written, in a fresh ``python3`` too."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_has_python_blocks():
  assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys, monkeypatch):
  # A fresh namespace per block: each must stand alone, imports included.
  # The blocks set XLA_FLAGS for a fresh process; keep this one's.
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "readme"})
  assert capsys.readouterr().out.strip(), "a README example prints what it shows"


def test_blocks_with_a_mesh_ask_for_devices_before_importing_jax():
  """A block that builds a multi-device mesh runs in a fresh ``python3`` on one CPU."""
  meshes = [b for b in BLOCKS if "make_mesh" in b]
  assert meshes
  for block in meshes:
    flag = block.index("--xla_force_host_platform_device_count=8")
    assert flag < block.index("import jax"), block[:200]


def test_export_block_runs_in_a_fresh_python_on_one_cpu():
  (block,) = [b for b in BLOCKS if "jax.export.export" in b]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run([sys.executable, "-c", block], env=env, capture_output=True,
                          text=True, timeout=600, cwd=README.parent)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip() == "('cpu',) (2, 2, 16) True"


def test_first_block_runs_in_a_fresh_python():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run([sys.executable, "-c", BLOCKS[0]], env=env, capture_output=True,
                          text=True, timeout=600, cwd=README.parent)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "EmbeddingPlan" in result.stdout


def test_the_tensorboard_sentence_names_the_extra_that_installs_the_viewer():
  import tomllib  # pylint: disable=g-import-not-at-top

  with open(README.parent / "pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
  assert extras["tensorboard"] == ["tensorboard"]
  text = " ".join(README.read_text().split())
  sentence = text[text.index("tensorboard --logdir"):][:200]
  assert "pip install -e '.[tensorboard]'" in sentence
