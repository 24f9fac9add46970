"""Sphinx configuration of embedlib's site: guides, notebooks and the API reference.

Build it from the repository root (warnings are errors, as in CI):

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The reference is generated from the docstrings (autodoc, autosummary,
napoleon for the Google style), and a public name without a docstring is
a warning; the notebooks are rendered as stored in ``notebooks/`` (or as
``docs/_ext/execute_notebooks.py`` ran them), never executed here; the table
of config keys is generated from ``configs/``.
"""

import inspect
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
# The checkout's embedlib and configs, whatever is installed; _ext holds the
# generators this file runs.
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]

from sphinx.util import inspect as sphinx_inspect  # noqa: E402  pylint: disable=g-import-not-at-top
from sphinx.util import logging  # noqa: E402  pylint: disable=g-import-not-at-top

import config_keys  # noqa: E402  pylint: disable=g-import-not-at-top
import notebook_pages  # noqa: E402  pylint: disable=g-import-not-at-top

project = "embedlib"
author = "embedlib authors"
copyright = "embedlib authors"  # pylint: disable=redefined-builtin

extensions = [
    "myst_nb",  # MyST markdown pages and .ipynb notebooks (includes myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "_generated", "_executed", "_ext", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

# Every reference to an embedlib name must resolve; names of other packages
# (jax, flax, numpy, builtins) would need their inventories, which the build
# doesn't fetch, so only those are let through.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!embedlib\b).*")]
# Internal classes that public signatures name: what a caller gets back
# or passes on, never builds (the reference documents the public side).
nitpick_ignore = [
    ("py:class", "embedlib.plan.placement.Placement"),
    ("py:class", "embedlib.collection.stacks.StackPlan"),
    ("py:class", "embedlib.checkpoint.sharded.ShardedArraysSave"),
    ("py:class", "embedlib.checkpoint.sharded.ShardedArraysRestore"),
    ("py:class", "embedlib.training.tasks.requests.RequestData"),
]

autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Notebooks are shown as stored: never executed by the build.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "sphinx_book_theme"
html_title = "embedlib"
html_theme_options = {"show_toc_level": 2, "max_navbar_depth": 2, "collapse_navbar": True}


def _init_signature(app, what, name, obj, options, signature, return_annotation):
  """An nnx.Module's own ``__init__`` signature, where autodoc found its metaclass's.

  ``nnx.Module``'s metaclass defines ``__call__(*args, **kwargs)``, which
  autodoc shows for every module class in place of its constructor.
  """
  del app, name, options, return_annotation
  if what != "class" or signature != "(*args: Any, **kwargs: Any)":
    return None
  sig = inspect.signature(obj.__init__)
  sig = sig.replace(parameters=list(sig.parameters.values())[1:],
                    return_annotation=inspect.Signature.empty)
  return sphinx_inspect.stringify_signature(sig, show_return_annotation=False), None


def _warn_without_docstring(app, what, name, obj, options, lines):
  """A page of the reference (a name the API pages list) must say what its name is."""
  del app, obj, options
  parent = name.rpartition(".")[0]
  if what in ("class", "exception", "function") and parent in sys.modules and not any(
      line.strip() for line in lines):
    logging.getLogger(__name__).warning(
        "%s has no docstring; write one (what it is, Args / Returns, an example)", name)


def _generate(app):
  unexplained = config_keys.write_page(DOCS / "_generated" / "config_keys.md")
  for key in unexplained:
    logging.getLogger(__name__).warning(
        "config key %r has no explanation (or more than one) in docs/_ext/config_keys.py; "
        "add one line for it to EXPLAINED", key)
  notebook_pages.copy_notebooks(ROOT / "notebooks", DOCS / "notebooks")


def setup(app):
  app.connect("builder-inited", _generate)
  app.connect("autodoc-process-signature", _init_signature)
  app.connect("autodoc-process-docstring", _warn_without_docstring)
