"""Every fenced Python block of README.md runs as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_readme_has_python_blocks():
  assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys):
  # A fresh namespace per block: each must stand alone, imports included.
  exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "readme"})
  assert capsys.readouterr().out.strip(), "a README example prints what it shows"
