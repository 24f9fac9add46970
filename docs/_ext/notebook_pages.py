"""The notebooks' pages: ``notebooks/*.ipynb`` copied into the site, never executed.

``notebooks/`` stores each notebook without outputs (the test suite runs
them), so its page shows the code and text with a note saying so. A copy
executed by hand into ``docs/_executed/NAME.ipynb`` (the command is on the
site's Notebooks page) is rendered instead, with its outputs.
"""

import json
import pathlib

EXECUTED = pathlib.Path(__file__).resolve().parents[1] / "_executed"

NOTE = ("*This page shows the notebook as stored in `notebooks/`, without outputs: "
        "run it (in Colab, or locally as the [Notebooks](index.md) page says) to see "
        "them.*")


def _has_outputs(notebook: dict) -> bool:
  return any(cell.get("outputs") for cell in notebook["cells"] if cell["cell_type"] == "code")


def _page(source: pathlib.Path) -> str:
  executed = EXECUTED / source.name
  notebook = json.loads((executed if executed.exists() else source).read_text())
  if not _has_outputs(notebook):
    # After the title cell, so the page keeps the notebook's own title.
    at = 1 if notebook["cells"] and notebook["cells"][0]["cell_type"] == "markdown" else 0
    note = {"cell_type": "markdown", "metadata": {}, "source": NOTE}
    if any("id" in cell for cell in notebook["cells"]):  # nbformat >= 4.5 cells carry ids
      note["id"] = "stored-without-outputs"
    notebook["cells"].insert(at, note)
  return json.dumps(notebook, indent=1) + "\n"


def copy_notebooks(source_dir: pathlib.Path, page_dir: pathlib.Path) -> None:
  """Writes each notebook's page into ``page_dir``, dropping pages of removed notebooks."""
  sources = {p.name: p for p in sorted(source_dir.glob("*.ipynb"))}
  for stale in page_dir.glob("*.ipynb"):
    if stale.name not in sources:
      stale.unlink()
  for name, source in sources.items():
    text = _page(source)
    target = page_dir / name
    # Rewritten only when changed, so an incremental build re-reads only what moved.
    if not target.exists() or target.read_text() != text:
      target.write_text(text)
