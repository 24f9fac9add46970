"""Constructor keywords that moved into a settings object, kept working for one release.

``ShardedEmbed(..., sharding="vocab")`` was written before the planning
settings moved into ``layout=embedlib.Layout(sharding="vocab")``. The old
keywords are still accepted until ``REMOVED_IN``; each call that uses one
warns with a ``DeprecationWarning`` showing the new spelling. The
constructor's signature (``help()``, ``inspect.signature``) shows only the
new arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings

#: The release that drops the old keywords.
REMOVED_IN = "embedlib 0.2"


def moved_keywords(owner: str, targets: dict, attributes: dict | None = None):
  """Decorates an ``__init__`` to accept the keywords that moved into ``targets``.

  Args:
    owner: the class's name, for the warning.
    targets: ``{argument: (settings class, public spelling)}``: an old
      keyword that names a field of the class is moved into that argument
      (a settings value, ``dataclasses.replace``'d; a new one where the
      caller gave none).
    attributes: ``{old keyword: new spelling}`` of keywords that became
      attributes set after construction.

  Returns:
    The decorator.
  """
  attributes = attributes or {}
  fields = {arg: {f.name for f in dataclasses.fields(cls)} for arg, (cls, _) in targets.items()}

  def decorate(init):
    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
      moved = {arg: {k: kwargs.pop(k) for k in list(kwargs) if k in names}
               for arg, names in fields.items()}
      later = {k: kwargs.pop(k) for k in list(kwargs) if k in attributes}
      for arg, old in moved.items():
        if old:
          kwargs[arg] = _merged(owner, arg, targets[arg], kwargs.get(arg), old)
      init(self, *args, **kwargs)
      for k, value in later.items():
        warn(f"{owner}({k}=...) is deprecated and will be removed in {REMOVED_IN}; "
              f"{attributes[k]}.")
        setattr(self, k, value)

    return wrapper

  return decorate


def _merged(owner, arg, target, given, old):
  cls, spelling = target
  names = ", ".join(f"{k}=..." for k in old)
  warn(f"{owner}({names}) is deprecated and will be removed in {REMOVED_IN}; pass "
        f"{arg}={spelling}({names}) instead.")
  if given is None:
    return cls(**old)
  defaults = cls()
  twice = [k for k in old if getattr(given, k) != getattr(defaults, k)]
  if twice:
    raise ValueError(
        f"{owner}: {twice[0]}= is given both as a keyword and in {arg}=; pass it once, "
        f"in {arg}={spelling}({twice[0]}=...).")
  return dataclasses.replace(given, **old)


def warn(message: str) -> None:
  """A ``DeprecationWarning`` at the caller's line: the first frame outside embedlib and flax."""
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  while frame is not None and frame.f_globals.get("__name__", "").startswith(
      ("flax.", "embedlib.")):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, DeprecationWarning, stacklevel=level + 1)
