"""The documentation covers the public API and the configs (pure Python; the site's build is CI's).

Public names are ``embedlib.__all__`` and the ``__all__`` of every
subpackage. Each class, function and module needs a docstring of its own,
and each name a place in the API reference (``docs/api/*.md``); each config
key needs one explanation in ``docs/_ext/config_keys.py``. The site as a reader
sees it: CI runs ``docs/_ext/check_site.py`` over the built HTML; here, that
the check sees the defects it exists for, and that no page source causes them.
"""

import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import re

import embedlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"


def _public_modules() -> list:
  """``embedlib`` and each of its packages that declares ``__all__``."""
  names = ["embedlib"] + [m.name for m in pkgutil.walk_packages(embedlib.__path__, "embedlib.")
                          if m.ispkg]
  modules = [importlib.import_module(name) for name in names]
  return [m for m in modules if hasattr(m, "__all__")]


def _public_names() -> dict[str, object]:
  """Dotted name -> object, for every name of every public ``__all__``."""
  return {f"{m.__name__}.{name}": getattr(m, name) for m in _public_modules()
          for name in m.__all__}


def _own_docstring(obj) -> str:
  doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
  doc = (doc or "").strip()
  if inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):
    return ""  # the signature a dataclass writes when the class has no docstring
  return doc


def _is_constant(obj) -> bool:
  return not (inspect.isclass(obj) or inspect.ismodule(obj) or callable(obj))


def _documented() -> tuple[set[int], set[str]]:
  """Ids of the objects the reference's autosummary tables list, and its py:data names."""
  text = "\n".join(p.read_text() for p in sorted(API.glob("*.md")))
  objects = set()
  for dotted in re.findall(r"^\s+~?(embedlib(?:\.\w+)+)\s*$", text, re.M):
    module, _, name = dotted.rpartition(".")
    objects.add(id(getattr(importlib.import_module(module), name)))
  data = set(re.findall(r"^```\{py:data\} (embedlib(?:\.\w+)+)$", text, re.M))
  return objects, data


def test_every_public_name_has_a_docstring():
  lacking = [name for name, obj in _public_names().items()
             if not _is_constant(obj) and not _own_docstring(obj)]
  lacking += [m.__name__ for m in _public_modules() if not (m.__doc__ or "").strip()]
  assert not lacking, (
      f"public names without a docstring of their own: {sorted(lacking)}; write one that "
      "says what it is, its Args / Returns and, where one helps, a >>> example")


def test_every_public_name_is_in_the_reference():
  objects, data = _documented()
  assert len(objects) > 50
  missing = [name for name, obj in _public_names().items()
             if (name not in data if _is_constant(obj) else id(obj) not in objects)]
  assert not missing, (
      f"public names missing from the API reference: {sorted(missing)}; list each in the "
      "autosummary table of its group in docs/api/*.md (a constant: a py:data directive "
      "there, with what it means)")


def _config_keys_module():
  spec = importlib.util.spec_from_file_location(
      "config_keys", ROOT / "docs" / "_ext" / "config_keys.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_every_config_key_is_explained_once():
  config_keys = _config_keys_module()
  keys = config_keys.config_values()
  assert "batch_size" in keys and "model.name" in keys
  wrong = {key: config_keys.explanations_of(key) for key in keys
           if len(config_keys.explanations_of(key)) != 1}
  assert not wrong, (
      f"config keys without exactly one explanation (key: the patterns that match it): "
      f"{wrong}; give each one line in EXPLAINED in docs/_ext/config_keys.py")
  unused = [p for p in config_keys.EXPLAINED
            if not any(config_keys.explanations_of(k) == [p] for k in keys)]
  assert not unused, f"explanations of keys no config has: {unused}; remove them"


# -- The site as a reader sees it ---------------------------------------------------------------

DOCS = ROOT / "docs"
# Directives that write reStructuredText: in a MyST fence their output is read as Markdown
# and shows as text (".. py:module:: ..."); inside an {eval-rst} fence they render.
_RST_WRITING = re.compile(r"^(`{3,}|:{3,})\{(auto(?!summary)\w+)\}", re.M)


def _check_site():
  spec = importlib.util.spec_from_file_location("check_site", DOCS / "_ext" / "check_site.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_BROKEN_PAGE = """<nav class="bd-docs-nav">
<p class="caption" role="heading"><span class="caption-text">Guides</span></p>
<ul class="nav bd-sidenav">
<li class="toctree-l1 has-children"><a class="reference internal" href="index.html">Guides</a>
<ul><li class="toctree-l2"><a href="layouts.html">Layouts</a></li></ul></li>
</ul></nav>
<article><h1>Planning</h1><p>.. py:module:: embedlib.plan</p><p>Layer 1.</p></article>"""

_CLEAN_PAGE = """<nav class="bd-docs-nav"><ul class="nav bd-sidenav">
<li class="toctree-l1"><a class="reference internal" href="guides/index.html">Guides</a></li>
</ul></nav>
<article><h1>Planning</h1><p>Layer 1.</p>
<pre>.. py:module:: shown as an example</pre><p>Slices: <code>x[:::]</code></p></article>"""


def test_the_site_check_sees_directive_text_and_a_repeated_caption():
  check = _check_site()
  problems = check.page_problems(_BROKEN_PAGE)
  assert len(problems) == 2, problems
  assert "'.. py:'" in problems[0] and "embedlib.plan" in problems[0]
  assert "Guides > Guides" in problems[1]
  assert check.page_problems(_CLEAN_PAGE) == []  # code blocks may show directives


def test_no_page_fences_a_directive_that_writes_rst():
  found = [f"{p.relative_to(ROOT)}: {{{m[2]}}}" for p in sorted(DOCS.rglob("*.md"))
           if "_build" not in p.parts for m in _RST_WRITING.finditer(p.read_text())]
  assert not found, (
      f"{found}: MyST reads these directives' reStructuredText output as Markdown, so the "
      "page shows '.. py:module:: ...' as text; write them in an {eval-rst} fence, e.g. "
      "```{eval-rst}\\n.. automodule:: embedlib.plan\\n   :no-members:\\n```")


def _title(page) -> str:
  return next(line[2:].strip() for line in page.read_text().splitlines()
              if line.startswith("# "))


def test_no_sidebar_caption_repeats_the_title_of_its_page():
  text = (DOCS / "index.md").read_text()
  repeated = []
  for block in re.findall(r"```\{toctree\}\n(.*?)```", text, re.S):
    caption = re.search(r"^:caption:\s*(.+)$", block, re.M)
    entries = [e.strip() for e in block.splitlines() if e.strip() and not e.startswith(":")]
    titles = [_title(DOCS / f"{e}.md") for e in entries]
    if caption and caption[1].strip() in titles:
      repeated.append(caption[1].strip())
  assert not repeated, (
      f"sidebar captions over a page of the same title ({repeated}: 'Guides > Guides'); list "
      "the page in a toctree without :caption:, or give the caption a title of its own")
