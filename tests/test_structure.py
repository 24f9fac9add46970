"""The library's shape, read from its source: small files, no private imports, no cycles.

Read statically (``ast``), so it costs nothing to run. A module-level import
is an edge; imports inside functions are not (they are how the code breaks
a cycle on purpose, and so are looked at by review, not here). A package's
``__init__`` re-exporting its own modules is not a cycle.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted((ROOT / "embedlib").rglob("*.py")):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


MODULES = _modules()


def _target(module: str, node: ast.ImportFrom) -> str | None:
  if not node.level:
    return node.module
  package = module.split(".")
  if MODULES[module].name != "__init__.py":
    package = package[:-1]
  package = package[:len(package) - (node.level - 1)]
  return ".".join(package + ([node.module] if node.module else []))


def _imports(module: str):
  """``(imported module, name or None)`` of each module-level import of embedlib."""
  for node in ast.parse(MODULES[module].read_text(encoding="utf-8")).body:
    if isinstance(node, ast.Import):
      yield from ((a.name, None) for a in node.names if a.name in MODULES)
    elif isinstance(node, ast.ImportFrom):
      target = _target(module, node)
      if target and target.split(".")[0] == "embedlib":
        for alias in node.names:
          full = f"{target}.{alias.name}"
          yield (full, None) if full in MODULES else (target, alias.name)


def test_no_library_file_is_over_600_lines():
  long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
          if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
  assert not long, f"split these files (at most {MAX_LINES} lines each): {long}"


def test_no_module_imports_another_modules_private_names():
  private = [f"{m} imports {t}.{name}" for m in MODULES for t, name in _imports(m)
             if name and name.startswith("_") and t != m]
  assert not private, private


def test_no_import_cycle_between_library_modules():
  def related(a, b):  # a package and its own modules
    return a.startswith(b + ".") or b.startswith(a + ".")

  edges = {m: {t for t, _ in _imports(m) if t in MODULES and not related(m, t)}
           for m in MODULES}
  done, path, cycles = set(), [], []

  def visit(m):
    if m in path:
      cycles.append(path[path.index(m):] + [m])
      return
    if m in done:
      return
    path.append(m)
    for t in sorted(edges[m]):
      visit(t)
    path.pop()
    done.add(m)

  for m in MODULES:
    visit(m)
  assert not cycles, cycles[:3]


def test_the_kernels_specification_is_for_tests_and_benchmarks_only():
  """``kernels.reference`` is what kernels are checked against: no library code runs it."""
  spec = "embedlib.kernels.reference"
  users = [m for m in MODULES for t, _ in _imports(m)
           if t == spec and m not in ("embedlib.kernels", spec)]
  assert not users, f"{users} import the test specification {spec}; use kernels.xla / bags"
