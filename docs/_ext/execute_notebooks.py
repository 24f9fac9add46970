"""Runs the notebooks into ``docs/_executed/``, so the next site build shows their outputs.

    python3 docs/_ext/execute_notebooks.py [NAME ...]    # default: every notebook

Run from anywhere, with the test extra installed (nbclient, ipykernel). Each
notebook runs in a fresh ``python3`` kernel of this interpreter from
``notebooks/`` (its working directory), as ``tests/notebooks`` runs them;
the environment passes through, so ``EMBEDLIB_NOTEBOOK_SMOKE=1`` runs the
training notebooks' smoke configs. ``notebooks/`` itself is left as stored.
The build never runs this: ``notebook_pages`` renders ``docs/_executed/NAME.ipynb``
in place of the stored notebook where it exists.
"""

import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
EXECUTED = ROOT / "docs" / "_executed"
CELL_TIMEOUT_S = 600


def main(names: list[str]) -> None:
  import nbformat  # pylint: disable=g-import-not-at-top
  from ipykernel import kernelspec  # pylint: disable=g-import-not-at-top
  from nbclient import NotebookClient  # pylint: disable=g-import-not-at-top

  names = names or sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
  unknown = [n for n in names if not (NOTEBOOKS / f"{n}.ipynb").exists()]
  if unknown:
    sys.exit(f"no notebooks/{unknown[0]}.ipynb; pass names from "
             f"{sorted(p.stem for p in NOTEBOOKS.glob('*.ipynb'))}")
  EXECUTED.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as prefix:
    # This interpreter's kernel, ahead of any user-level "python3" kernelspec.
    kernelspec.install(kernel_name="python3", prefix=prefix)
    os.environ["JUPYTER_PATH"] = str(pathlib.Path(prefix) / "share" / "jupyter")
    for name in names:
      notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
      NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                     resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
      nbformat.write(notebook, EXECUTED / f"{name}.ipynb")
      print(f"docs/_executed/{name}.ipynb")


if __name__ == "__main__":
  main(sys.argv[1:])
