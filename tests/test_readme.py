"""Every fenced Python block of README.md and the docs' pages runs as written, in a fresh ``python3`` too.

The blocks are those of ``README.md``, ``docs/*.md`` and ``docs/guides/*.md``
(a page added there joins); a block that appears on two pages (the README's
example opens the site's front page too) runs once.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "guides").glob("*.md"))]


def _blocks(path: pathlib.Path) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def _distinct_blocks() -> list[tuple[str, str]]:
  """(where, block) of each distinct block, first place it appears."""
  seen, out = set(), []
  for page in PAGES:
    for i, block in enumerate(_blocks(page)):
      if block not in seen:
        seen.add(block)
        out.append((f"{page.relative_to(ROOT)} block {i}", block))
  return out


README_BLOCKS = _blocks(README)
BLOCKS = _distinct_blocks()


def test_readme_and_guides_have_python_blocks():
  assert len(README_BLOCKS) >= 1
  guides = [where for where, _ in BLOCKS if where.startswith("docs/guides/")]
  assert len(guides) >= 5, guides


def _runs_fresh(block: str) -> bool:
  """The README's first block and the export block run in a fresh ``python3`` below."""
  return block == README_BLOCKS[0] or "jax.export.export" in block


IN_PROCESS = [(where, b) for where, b in BLOCKS if not _runs_fresh(b)]


@pytest.mark.parametrize("where,block", IN_PROCESS, ids=[where for where, _ in IN_PROCESS])
def test_block_runs(where, block, capsys, monkeypatch):
  # A fresh namespace per block: each must stand alone, imports included.
  # The blocks set XLA_FLAGS for a fresh process; keep this one's.
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  exec(compile(block, where, "exec"), {"__name__": "readme"})
  assert capsys.readouterr().out.strip(), f"{where}: an example prints what it shows"


def test_blocks_with_a_mesh_ask_for_devices_before_importing_jax():
  """A block that builds a multi-device mesh runs in a fresh ``python3`` on one CPU."""
  meshes = [(where, b) for where, b in BLOCKS if "make_mesh" in b]
  assert meshes
  for where, block in meshes:
    assert "--xla_force_host_platform_device_count=8" in block, where
    flag = block.index("--xla_force_host_platform_device_count=8")
    assert flag < block.index("import jax"), where


def test_export_block_runs_in_a_fresh_python_on_one_cpu():
  (block,) = [b for _, b in BLOCKS if "jax.export.export" in b]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run([sys.executable, "-c", block], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip() == "('cpu',) (2, 2, 16) True"


def test_first_block_runs_in_a_fresh_python():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run([sys.executable, "-c", README_BLOCKS[0]], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "EmbeddingPlan" in result.stdout


def test_the_readme_links_to_pages_that_exist():
  links = re.findall(r"\]\(([^)#]+)\)", README.read_text())
  assert links
  missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
  assert not missing, f"README.md links to {missing}, which don't exist"


def test_the_tensorboard_sentence_names_the_extra_that_installs_the_viewer():
  import tomllib  # pylint: disable=g-import-not-at-top

  with open(ROOT / "pyproject.toml", "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
  assert extras["tensorboard"] == ["tensorboard"]
  text = " ".join((ROOT / "docs" / "guides" / "training.md").read_text().split())
  sentence = text[text.index("tensorboard --logdir"):][:200]
  assert "pip install -e '.[tensorboard]'" in sentence
