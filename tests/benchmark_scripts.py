"""Imports a script of ``benchmarks/`` by path, for tests of its checks."""

import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
  """``benchmarks/<name>.py`` as a module; the ``sys.path`` entries it adds are undone."""
  saved = list(sys.path)
  try:
    spec = importlib.util.spec_from_file_location(f"{name}_script", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = saved
  return module
