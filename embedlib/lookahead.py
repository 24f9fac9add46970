"""Lookups whose ids were distributed ahead: the scope a pipelined step opens.

A pipelined train step runs the loss on batch N+1 once more, on a copy of
the model, inside ``collecting``: there every ``ShardedEmbed`` lookup only
distributes its ids (``strategies.distribute``) and returns zero
rows, so what the program keeps of that pass is the ids' movement alone
(the rest of the loss is dead and XLA drops it). Step N+1 then runs its loss
inside ``using(those)``: each lookup takes the distribution made for it
and only reads and moves rows (``strategies.finish``).

Lookups are matched by table, request shapes and call order, as the tape
of ``embedlib.optim`` matches them; a loss is traced more than once
(``optim.value_and_grad`` traces it for shapes first), and each trace
takes the distributions from the start. A lookup the scope doesn't know
raises instead of being looked up from another batch's ids.

A dynamic table (``embedlib.DynamicEmbed``) adds its map's step to the
distributions too: collecting, it steps its map on the ids from the map
the batch before left (``collecting(previous=...)``), without touching its
rows; using, it takes that map and places its new rows, then looks the rows
up as above. A map is a function of the ids seen alone, so it runs ahead
exactly.

The scope lives in a ``contextvars.ContextVar`` and only affects lookups
traced under it (``ShardedEmbed`` and ``DynamicEmbed`` read it; nothing
else does).
"""

from __future__ import annotations

import contextlib
import contextvars

from flax import struct

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("embedlib_lookahead", default=None)


@struct.dataclass
class Distributions:
  """The ids' distributions of one batch's lookups, in call order (a pytree).

  Attributes:
    values: one ``strategies.distribute`` result per lookup (None
      for a lookup made in line).
    keys: each lookup's static key (table, request shapes, options).
  """

  values: tuple
  keys: tuple = struct.field(pytree_node=False, default=())


class _Collecting:
  def __init__(self, early_fetch, previous):
    self.values, self.keys = [], []
    self.early_fetch = early_fetch
    self.previous = None if previous is None else _Using(previous)

  def add(self, key, value):
    self.values.append(value)
    self.keys.append(key)

  def previous_value(self, key):
    """What the batch before collected for ``key`` (None: no such lookup, or none given)."""
    if self.previous is None or key not in self.previous.by_key:
      return None
    return self.previous.take(key)


class _Using:
  def __init__(self, distributions: Distributions):
    self.by_key = {}
    for key, value in zip(distributions.keys, distributions.values):
      self.by_key.setdefault(key, []).append(value)
    self.taken = {}

  def take(self, key):
    found = self.by_key.get(key)
    if found is None:
      raise ValueError(
          f"table {key[0]!r}: a lookup of ids {key[1]} that the batch read ahead made no "
          "lookup of. A pipelined step needs each lookup's ids to follow from the batch "
          "alone, made the same way on every batch (not drawn from the model's state); "
          "run this loss with the in-line step (config.pipeline=False, "
          "embedlib.training.train_step).")
    n = self.taken.get(key, 0)
    # A second trace of the loss makes the same lookups again: start over.
    self.taken[key] = n + 1
    return found[n % len(found)]


def active():
  """The scope the lookups traced now run in: None, collecting or using."""
  return _ACTIVE.get()


def is_collecting(scope) -> bool:
  return isinstance(scope, _Collecting)


def is_using(scope) -> bool:
  return isinstance(scope, _Using)


@contextlib.contextmanager
def collecting(early_fetch: float = 0.0, previous: Distributions | None = None):
  """Lookups inside only distribute their ids; yields a callable giving the ``Distributions``.

  ``early_fetch`` (0: off) fetches routed and vocab tables' rows too, with
  that share of each rank's rows for corrected rows
  (``strategies.distribute``). ``previous``: the distributions of the
  batch before, not yet looked up, for a lookup whose distribution follows
  from the one before it (a dynamic table's map: ``embedlib.dynamic``).
  """
  scope = _Collecting(early_fetch, previous)
  token = _ACTIVE.set(scope)
  try:
    yield lambda: Distributions(tuple(scope.values), tuple(scope.keys))
  finally:
    _ACTIVE.reset(token)


@contextlib.contextmanager
def using(distributions: Distributions):
  """Lookups inside read rows from ``distributions`` (one batch's, from ``collecting``)."""
  token = _ACTIVE.set(_Using(distributions))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def read_ahead(scope, key, collect, use):
  """A lookup under a pipelined step's ``scope``: the one branch every table kind takes.

  Collecting, ``collect(scope)`` gives ``(distribution, output)``: the
  distribution is kept under ``key`` for the step that uses it and the
  output (zero rows; a map's rows) is the lookup's now. Using,
  ``use(distribution)`` gives the lookup's output from the distribution
  collected for ``key``.
  """
  if is_collecting(scope):
    distribution, out = collect(scope)
    scope.add(key, distribution)
    return out
  return use(scope.take(key))


def request_key(name, requests, num_unique, on_overflow) -> tuple:
  """A lookup's static key: its table, each request's shapes and kind, its options."""
  return (name, tuple((tuple(r.ids.shape), None if r.weights is None else tuple(r.weights.shape),
                       r.combiner, r.member) for r in requests), num_unique, on_overflow)
