"""Request batches of the ranker and the two towers: a user, an engagement history, items.

The batch format (the one place it is documented)
--------------------------------------------------
A request batch is a dict of numpy arrays holding this process's rows
(``B = batch_size // process_count``); ``S = history_len``,
``C = num_candidates``, ``A = len(actions)``::

    {
        "user":             int64   [B]        raw user ids (>= 0, any size: hashed later)
        "history_item":     int32   [B, S]     item ids, right-padded with -1
        "history_author":   int32   [B, S]     their authors, -1 where padded
        "history_actions":  float32 [B, S, A]  multi-hot: the actions taken on each
        # ranking (several candidates per request, labels per action):
        "candidate_item":   int32   [B, C]     right-padded with -1
        "candidate_author": int32   [B, C]
        "labels":           float32 [B, C, A]  0/1, 0 where padded
        # retrieval (one engaged item per request):
        "item":             int32   [B]
        "author":           int32   [B]
    }

Item ids lie in ``[0, num_items)`` and author ids in ``[0, num_authors)``.
Actions are multi-hot over ``actions``; ``action_multi_hot`` turns lists of
action indices (the way logs record them) into that form, refusing an index
past the list. ``SequenceSpec.check_batch`` checks a batch against a spec and
names the first field out of it, with the fix.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from embedlib.data.spec import MAX_ROWS, PAD_ID

#: The actions a planted source draws, in label order.
ACTIONS = ("click", "like", "reply", "share", "dwell")
RANKING = "ranking"
RETRIEVAL = "retrieval"
KINDS = (RANKING, RETRIEVAL)


class BadBatchError(ValueError):
  """A request batch out of its spec; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
  """Sizes of request batches: vocabularies, history and candidate lengths, actions.

  >>> spec = SequenceSpec(num_items=1000, num_authors=50, history_len=8, num_candidates=4)
  >>> spec.num_actions, {k: v.shape for k, v in spec.zeros(2).items()}["labels"]
  (5, (2, 4, 5))

  Attributes:
    num_items: item ids lie in ``[0, num_items)``.
    num_authors: author ids lie in ``[0, num_authors)``.
    history_len: ``S``, the most history events a request holds.
    num_candidates: ``C``, the most candidates a ranking request holds
      (0 for retrieval batches).
    actions: names of the actions, in label order.
  """

  num_items: int
  num_authors: int
  history_len: int
  num_candidates: int = 0
  actions: tuple[str, ...] = ACTIONS

  def __post_init__(self):
    object.__setattr__(self, "actions", tuple(self.actions))
    for field, low in (("num_items", 1), ("num_authors", 1), ("history_len", 1),
                       ("num_candidates", 0)):
      value = getattr(self, field)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"config.data.{field} must be an int >= {low}, got {value!r}.")
    for field in ("num_items", "num_authors"):
      if getattr(self, field) > MAX_ROWS:
        raise ValueError(f"config.data.{field}={getattr(self, field)} is more ids than int32 "
                         f"addresses (at most {MAX_ROWS}); hash them into fewer rows.")
    if not self.actions or len(set(self.actions)) != len(self.actions):
      raise ValueError(f"config.data.actions={self.actions} must name at least one action, "
                       "each once.")

  @property
  def num_actions(self) -> int:
    return len(self.actions)

  def zeros(self, batch_size: int, kind: str = RANKING) -> dict:
    """An empty batch of ``batch_size`` requests: one history event, one candidate."""
    b, s, a = batch_size, self.history_len, self.num_actions
    batch = {
        "user": np.zeros((b,), np.int64),
        "history_item": np.full((b, s), PAD_ID, np.int32),
        "history_author": np.full((b, s), PAD_ID, np.int32),
        "history_actions": np.zeros((b, s, a), np.float32),
    }
    batch["history_item"][:, 0] = batch["history_author"][:, 0] = 0
    if kind == RANKING:
      c = self.num_candidates
      batch["candidate_item"] = np.full((b, c), PAD_ID, np.int32)
      batch["candidate_author"] = np.full((b, c), PAD_ID, np.int32)
      batch["candidate_item"][:, 0] = batch["candidate_author"][:, 0] = 0
      batch["labels"] = np.zeros((b, c, a), np.float32)
    else:
      batch["item"] = np.zeros((b,), np.int32)
      batch["author"] = np.zeros((b,), np.int32)
    return batch

  def check_batch(self, batch: dict, kind: str = RANKING) -> None:
    """Raises ValueError naming the first field whose shape, dtype or ids are out of spec.

    >>> spec = SequenceSpec(num_items=10, num_authors=3, history_len=4, num_candidates=2)
    >>> spec.check_batch(spec.zeros(2))
    >>> bad = spec.zeros(2); bad["candidate_item"][0, 0] = 10
    >>> spec.check_batch(bad)
    Traceback (most recent call last):
    ...
    embedlib.data.sequences.BadBatchError: batch["candidate_item"] has id 10 outside [0, 10) (config.data.num_items=10); raise config.data.num_items ...

    Args:
      batch: a request batch (module docstring).
      kind: ``"ranking"`` or ``"retrieval"``.
    """
    if kind not in KINDS:
      raise BadBatchError(f"kind={kind!r}; use one of {KINDS}.")
    keys = {"user", "history_item", "history_author", "history_actions"}
    keys |= {"candidate_item", "candidate_author", "labels"} if kind == RANKING else {
        "item", "author"}
    missing = sorted(keys - set(batch))
    if missing:
      raise BadBatchError(f"a {kind} batch lacks {missing}; see embedlib.data.sequences.")
    user = np.asarray(batch["user"])
    b = user.shape[0] if user.ndim == 1 else -1
    _check_shape("user", user, (b,), "[batch] raw user ids")
    if user.dtype.kind not in "iu" or (user.dtype.kind == "i" and (user < 0).any()):
      raise BadBatchError(f'batch["user"] must hold integer ids >= 0, got {user.dtype} '
                       f"{user.min() if user.size else ''}; map missing users to an id of their own.")
    self._check_list("history", batch, b, self.history_len, "history_len")
    if kind == RANKING:
      self._check_list("candidate", batch, b, self.num_candidates, "num_candidates")
      labels = batch["labels"]
      _check_shape("labels", labels, (b, self.num_candidates, self.num_actions),
                   "[batch, num_candidates, num_actions] 0/1 labels", "data.actions")
      _check_binary("labels", labels)
    else:
      _check_ids("item", batch["item"], (b,), self.num_items, "num_items", padded=False)
      _check_ids("author", batch["author"], (b,), self.num_authors, "num_authors", padded=False)

  def _check_list(self, prefix, batch, b, length, length_key):
    items = np.asarray(batch[f"{prefix}_item"])
    if items.ndim == 2 and items.shape[0] == b and items.shape[1] > length:
      raise BadBatchError(
          f'batch["{prefix}_item"] holds {items.shape[1]} {prefix} entries per request, more '
          f"than config.data.{length_key}={length}; keep the newest {length} (truncate it) "
          f"or raise config.data.{length_key}.")
    _check_ids(f"{prefix}_item", items, (b, length), self.num_items, "num_items")
    _check_ids(f"{prefix}_author", batch[f"{prefix}_author"], (b, length), self.num_authors,
               "num_authors")
    if prefix == "history":
      actions = batch["history_actions"]
      _check_shape("history_actions", actions, (b, length, self.num_actions),
                   "[batch, history_len, num_actions] multi-hot actions", "data.actions")
      _check_binary("history_actions", actions)


def action_multi_hot(action_lists, num_actions: int, field: str = "history_actions"):
  """Lists of action indices (``-1`` padded) to multi-hot float32 ``[..., num_actions]``.

  >>> action_multi_hot(np.array([[0, 2], [1, -1]]), 3).tolist()
  [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
  >>> action_multi_hot(np.array([[5]]), 3)
  Traceback (most recent call last):
  ...
  embedlib.data.sequences.BadBatchError: history_actions: action index 5 at [0, 0] is past num_actions=3 ...

  Args:
    action_lists: int ``[..., max_actions]``, each entry an action index or -1.
    num_actions: ``len(config.data.actions)``.
    field: the batch field, for the error message.
  """
  lists = np.asarray(action_lists)
  bad = np.argwhere((lists >= num_actions) | (lists < PAD_ID))
  if bad.size:
    where = tuple(int(i) for i in bad[0])
    raise BadBatchError(
        f"{field}: action index {int(lists[where])} at {list(where)} is past "
        f"num_actions={num_actions} (indices lie in [0, {num_actions}), -1 pads); add the "
        "action to config.data.actions or drop it from the data.")
  hot = np.zeros(lists.shape[:-1] + (num_actions,), np.float32)
  idx = np.nonzero(lists >= 0)
  hot[idx[:-1] + (lists[idx],)] = 1.0
  return hot


def _check_shape(field, array, shape, what, config_key=None):
  array = np.asarray(array)
  expected = tuple(s if s >= 0 else n for s, n in zip(shape, array.shape))
  if array.shape != expected or len(shape) != array.ndim:
    hint = f" (config.{config_key})" if config_key else ""
    raise BadBatchError(f'batch["{field}"] must be {what}{hint}, shape {list(shape)}, '
                     f"got {list(array.shape)}.")


def _check_binary(field, array):
  array = np.asarray(array)
  if not np.isin(array, (0, 1)).all():
    raise BadBatchError(f'batch["{field}"] must hold 0/1 values (multi-hot); threshold or '
                     "one-hot encode them first (embedlib.data.action_multi_hot).")


def _check_ids(field, ids, shape, size, size_key, padded=True):
  ids = np.asarray(ids)
  _check_shape(field, ids, shape, "int ids" + (", right-padded with -1" if padded else ""))
  if ids.dtype.kind not in "iu":
    raise BadBatchError(f'batch["{field}"] must hold integer ids, got {ids.dtype}.')
  low = PAD_ID if padded else 0
  bad = ids[(ids < low) | (ids >= size)]
  if bad.size:
    raise BadBatchError(
        f'batch["{field}"] has id {int(bad[0])} outside [{max(low, 0)}, {size}) '
        f"(config.data.{size_key}={size}); raise config.data.{size_key} or map the ids "
        "into the vocabulary" + (" (-1 pads)." if padded else "."))
