"""Imports a script of ``benchmarks/`` by path, for tests of its checks."""

import importlib.util
import json
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
  """``benchmarks/<name>.py`` as a module; the ``sys.path`` entries it adds are undone."""
  saved = list(sys.path)
  try:
    spec = importlib.util.spec_from_file_location(f"{name}_script", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = saved
  return module


def read_record(path, ratios=()) -> dict:
  """The ``--json FILE`` record a script wrote, checked for the format's keys
  (``benchmarks/timing.py``'s ``check_record``) and for ``ratios``' names."""
  record = json.loads(pathlib.Path(path).read_text())
  load("timing").check_record(record)
  missing = sorted(set(ratios) - set(record["ratios"]))
  assert not missing, f"the record lacks ratios {missing}: it has {sorted(record['ratios'])}"
  assert len(record["machine"]["copy_gbps"]) >= 2, record["machine"]
  return record
