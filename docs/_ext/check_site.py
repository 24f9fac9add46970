"""The built site as a reader sees it: no directive left as text, no caption repeated.

``sphinx -W`` passes a MyST fence whose directive writes reStructuredText
(``{automodule}``): MyST reads that output as Markdown, and the page shows
``.. py:module:: embedlib...`` as a paragraph. Nor does it see a sidebar
caption whose only entry is a page of the same title ("Guides > Guides").
This reads the HTML for both, outside code blocks:

    python3 docs/_ext/check_site.py docs/_build/html

exits 1 listing each problem (page: what), 0 when there is none.
"""

import html
import pathlib
import re
import sys

#: Text that only a directive the build didn't run leaves on a page.
LEFTOVERS = (".. py:", ".. auto", "{automodule}", "{autoclass}", "{autofunction}",
             "{eval-rst}", "{toctree}", ":::")

_CODE = re.compile(r"<(pre|script|style|code)\b.*?</\1>", re.S | re.I)
_TAG = re.compile(r"<[^>]+>")
_CAPTION = re.compile(
    r'<span class="caption-text">(?P<caption>.*?)</span>.*?<ul[^>]*>(?P<entries>.*?)</ul>',
    re.S)
_FIRST_LEVEL = re.compile(r'<li class="toctree-l1[^"]*"><a [^>]*>(?P<title>.*?)</a>', re.S)


def _text(fragment: str) -> str:
  return " ".join(html.unescape(_TAG.sub(" ", fragment)).split())


def page_problems(page: str) -> list[str]:
  """What a reader would see wrong on one HTML page (empty when nothing)."""
  problems = []
  text = html.unescape(_TAG.sub(" ", _CODE.sub(" ", page)))
  for line in text.splitlines():
    found = [m for m in LEFTOVERS if m in line]
    if found:
      problems.append(f"directive text {found[0]!r} left on the page: {line.strip()[:80]!r}")
  for match in _CAPTION.finditer(page):
    caption = _text(match["caption"])
    titles = [_text(t) for t in _FIRST_LEVEL.findall(match["entries"])]
    if caption in titles:
      problems.append(f"sidebar caption {caption!r} over a page of the same title "
                      f"({caption} > {caption})")
  return problems


def site_problems(root) -> list[str]:
  """``page: problem`` for every HTML page under ``root`` but highlighted sources."""
  root = pathlib.Path(root)
  pages = [p for p in sorted(root.rglob("*.html")) if "_modules" not in p.parts]
  if not pages:
    return [f"{root}: no HTML pages; build the site first"]
  return [f"{page.relative_to(root)}: {problem}" for page in pages
          for problem in page_problems(page.read_text(encoding="utf-8"))]


if __name__ == "__main__":
  found = site_problems(sys.argv[1] if len(sys.argv) > 1 else "docs/_build/html")
  print("\n".join(found) or "check_site: no directive text and no repeated caption")
  sys.exit(1 if found else 0)
