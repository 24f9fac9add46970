"""The Colab notebooks run top to bottom, match their jupytext pairs, and hold no outputs.

Each notebook runs in a fresh ``python3`` kernel of this interpreter, on the
8 simulated CPU devices that ``conftest.py`` sets (the kernel inherits the
environment), with ``EMBEDLIB_NOTEBOOK_SMOKE=1`` so the training notebook runs
the smoke config. A cell that raises fails its notebook's test.
"""

import pathlib

import jupytext
import nbformat
import pytest
from ipykernel import kernelspec
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NAMES = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
#: ``embedlib._deprecated``'s warnings, printed in the kernel wherever they are raised (by
#: default Python shows a DeprecationWarning only when ``__main__`` triggers it).
DEPRECATED = ",".join(f"default:{owner}:DeprecationWarning"
                      for owner in ("ShardedEmbed", "DynamicEmbed", "EmbeddingCollection"))


def test_every_notebook_has_its_pair():
  assert NAMES, f"no notebooks in {NOTEBOOKS}"
  scripts = sorted(p.stem for p in NOTEBOOKS.glob("*.py"))
  assert scripts == NAMES, (
      "each notebooks/NAME.ipynb needs notebooks/NAME.py and back; pair a new one with "
      "`jupytext --set-formats ipynb,py:percent notebooks/NAME.ipynb`")


@pytest.mark.parametrize("name", NAMES)
def test_pair_in_sync(name):
  nb = jupytext.read(NOTEBOOKS / f"{name}.ipynb")
  text = jupytext.read(NOTEBOOKS / f"{name}.py")
  assert nb.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent"
  cells = lambda notebook: [(c.cell_type, c.source.strip()) for c in notebook.cells]
  assert cells(nb) == cells(text), (
      f"notebooks/{name}.ipynb and .py differ; run `jupytext --sync notebooks/{name}.py` "
      "(or .ipynb, whichever you edited)")


@pytest.mark.parametrize("name", NAMES)
def test_stored_without_outputs(name):
  nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and
           (c.outputs or c.execution_count is not None)]
  assert not dirty, (
      f"notebooks/{name}.ipynb stores outputs in cells {dirty}; clear them "
      f"(`jupyter nbconvert --clear-output --inplace notebooks/{name}.ipynb`)")


@pytest.fixture(scope="module")
def kernel_path(tmp_path_factory):
  """A ``python3`` kernelspec for this interpreter, ahead of any user-level one."""
  prefix = tmp_path_factory.mktemp("kernel")
  kernelspec.install(kernel_name="python3", prefix=str(prefix))
  return prefix / "share" / "jupyter"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_runs_top_to_bottom(name, kernel_path, monkeypatch, tmp_path):
  monkeypatch.setenv("JUPYTER_PATH", str(kernel_path))
  monkeypatch.setenv("EMBEDLIB_NOTEBOOK_SMOKE", "1")
  monkeypatch.setenv("TMPDIR", str(tmp_path))  # the training notebook's workdir
  monkeypatch.setenv("PYTHONWARNINGS", DEPRECATED)
  nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                          resources={"metadata": {"path": str(NOTEBOOKS)}})
  client.execute()  # raises CellExecutionError, with the traceback, if a cell fails
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
  old = [o.text for c in nb.cells if c.cell_type == "code" for o in c.outputs
         if o.output_type == "stream" and "will be removed in embedlib" in o.text]
  assert not old, f"{name} writes a deprecated spelling: {old}"
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert images or name == "quickstart", f"{name} drew no figure"
