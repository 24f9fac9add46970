"""A table's key: its module path, joined the same way everywhere.

The sparse optimizer's gradients (``optim.Grads.rows``), the dynamic tables'
statistics and slots, and the checkpoint's id-to-row maps all name a table
by where it sits in the model. They join the path here, below every one of
them, so a dynamic table (a module) names itself without importing the
optimizer above it.
"""

from __future__ import annotations


def table_key(path) -> str:
  """A table's key: its module path joined by ``/``.

  >>> table_key(("towers", 0, "user")), table_key(())
  ('towers/0/user', '')
  """
  return "/".join(str(p) for p in path)
