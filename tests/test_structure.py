"""The library's shape, read from its source: small files, no private imports, no cycles,
and the layers ``embedlib/__init__.py`` lists.

Read statically (``ast``), so it costs nothing to run. A module-level import
is an edge; imports inside functions are not (they are how the code breaks
a cycle on purpose, and so are looked at by review, not here). A package's
``__init__`` re-exporting its own modules is not a cycle.
"""

import ast
import pathlib
import re

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


def _layers() -> list[set[str]]:
  """The layers ``embedlib/__init__.py``'s docstring lists, lowest first: sets of names."""
  doc = ast.get_docstring(ast.parse(MODULES["embedlib"].read_text(encoding="utf-8")))
  items = re.split(r"^(\d+)\. ", doc.split("\n\nthen ")[0], flags=re.M)[1:]
  assert [int(n) for n in items[::2]] == list(range(1, len(items) // 2 + 1)), items[::2]
  return [set(re.findall(r"``(\w+)``", text.split(":")[0])) for text in items[1::2]]


def _part(module: str) -> str:
  """The first name under ``embedlib`` (a subpackage or a module of the root)."""
  return module.split(".")[1] if "." in module else module


def test_the_layer_list_in_embedlib_init_is_the_import_graph():
  layers = _layers()
  layer = {name: i for i, names in enumerate(layers) for name in names}
  parts = {_part(m) for m in MODULES if m != "embedlib"}
  assert parts == set(layer), (
      f"embedlib/__init__.py's layer list misses {sorted(parts - set(layer))} and names "
      f"{sorted(set(layer) - parts)}, which is no module; list each in its layer")
  upward = [f"{m} imports {t} (layer {layer[_part(t)] + 1} >= {layer[_part(m)] + 1})"
            for m in MODULES if m != "embedlib" for t, _ in _imports(m)
            if t.startswith("embedlib.") and _part(t) != _part(m)
            and layer[_part(t)] >= layer[_part(m)]]
  assert not upward, (
      f"{upward}: a layer imports only those listed above it in embedlib/__init__.py; move "
      "the import down, or the module, and write the list as the graph is")
