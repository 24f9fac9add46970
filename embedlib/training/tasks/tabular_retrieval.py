"""The tabular two towers' eval: each eval row's item ranked among the training rows' items.

The corpus is every distinct item of the training rows, with the item
columns of its first row (the item tower reads only those). Each eval row
(a positive one, where the table has a label) is a query: its rank is the
number of corpus items scored above its own item; recall@K is the share of
queries ranked below K. An item the training rows never held is not in the
corpus and counts as a miss. Scores are computed on the host in chunks of
the corpus, so the corpus may be far larger than a batch.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from embedlib import data as data_lib
from embedlib.tabular import schema as schema_lib
from embedlib.tabular import split as split_lib

_CHUNK = 8192


def _keys(ids) -> np.ndarray:
  """Host item ids as one uint64 a row (a dynamic column's raw id, or its row)."""
  ids = np.asarray(ids)
  return ids.astype(np.uint64) if ids.ndim == 1 else ids.reshape(len(ids))


def _gather(x):
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def corpus_rows(task) -> tuple[np.ndarray, dict]:
  """``(keys, rows)``: the training rows' distinct items and the arrays of each's first row."""
  cached = task.found.get("corpus")
  if cached is not None:
    return cached
  p = task.prepared
  item = p.schema.role_column(schema_lib.ITEM_ID)
  part = split_lib.ALL if p.split.kind == split_lib.FILES else split_lib.TRAIN
  source = p.source(part, batch_size=4096, num_epochs=1, pad_last=True)
  seen, keys, rows = set(), [], []
  for batch in source:
    ids = _keys(batch["sparse"][item])
    valid = batch["mask"] > 0
    for i in np.flatnonzero(valid):
      k = int(ids[i])
      if k not in seen:
        seen.add(k)
        keys.append(k)
        rows.append((batch, i))
  picked = _stack([b for b, _ in rows], [i for _, i in rows])
  found = (np.asarray(keys, np.uint64), picked)
  task.found["corpus"] = found
  return found


def _stack(batches, index):
  """The rows ``batches[j][index[j]]``, as one batch."""
  first = batches[0]
  if isinstance(first, dict):
    return {k: _stack([b[k] for b in batches], index) for k in first}
  return np.stack([b[i] for b, i in zip(batches, index)])


def _item_vectors(task, model, mesh, rows: dict, batch_size: int) -> np.ndarray:
  """The item tower's vectors of the corpus rows, ``[N, features]``."""
  from embedlib.training import steps  # pylint: disable=g-import-not-at-top

  n = len(rows["dense"])
  count, index = jax.process_count(), jax.process_index()
  local = batch_size // count
  out = []
  for start in range(0, n, batch_size):
    take = np.minimum(np.arange(start, start + batch_size), n - 1)
    mine = take[index * local:(index + 1) * local]
    batch = {k: v for k, v in _select(rows, mine).items() if k not in ("mask", "label")}
    batch["label"] = np.ones((local,) if task.num_labels == 1 else (local, task.num_labels),
                             np.float32)
    global_batch = data_lib.to_global_batch(task.featurize(batch), mesh)
    _, items = steps.eval_step(model, global_batch, task=task)
    out.append(_gather(items)[:min(batch_size, n - start)])
  return np.concatenate(out)


def _select(tree, index):
  if isinstance(tree, dict):
    return {k: _select(v, index) for k, v in tree.items()}
  return tree[index]


def recall(task, model, batches, mesh) -> dict:
  """``recall@K`` for ``task.recall_ks`` over the eval batches (module docstring)."""
  from embedlib.training import steps  # pylint: disable=g-import-not-at-top

  keys, rows = corpus_rows(task)
  item = task.prepared.schema.role_column(schema_lib.ITEM_ID)
  order = np.argsort(keys)
  sorted_keys = keys[order]
  vectors = None
  ranks = []
  for batch in batches:
    if vectors is None:
      size = batch["dense"].shape[0]
      vectors = _item_vectors(task, model, mesh, rows, size)
    users, _ = steps.eval_step(model, batch, task=task)
    users = _gather(users)
    ids = batch["sparse"][item]
    ids = _gather(ids.value if hasattr(ids, "value") else ids)
    if ids.ndim == 2:  # raw ids as words: back to one uint64
      ids = (ids[:, 0].astype(np.uint64) << np.uint64(32)) | ids[:, 1].astype(np.uint64)
    weight = _gather(batch["mask"])
    if task.positives_only:
      label = _gather(batch["label"])
      weight = weight * ((label if label.ndim == 1 else label[:, 0]) > 0)
    target = _corpus_index(sorted_keys, order, _keys(ids))
    queries = np.flatnonzero(weight > 0)
    ranks.append(_ranks(users[queries], vectors, target[queries]))
  if not sum(len(r) for r in ranks):
    raise ValueError("the eval rows hold no query (a positive row); check the split and "
                     "config.data.label_threshold.")
  ranks = np.concatenate(ranks)
  return {f"recall@{k}": float(np.mean(ranks < k)) for k in task.recall_ks}


def _corpus_index(sorted_keys, order, ids) -> np.ndarray:
  """Each id's index in the corpus, or -1 where the corpus lacks it."""
  at = np.clip(np.searchsorted(sorted_keys, ids), 0, max(len(sorted_keys) - 1, 0))
  found = sorted_keys[at] == ids
  return np.where(found, order[at], -1)


def _ranks(users, vectors, targets) -> np.ndarray:
  """How many corpus items score above each query's target (the corpus size if absent)."""
  present = targets >= 0
  own = np.einsum("qd,qd->q", users, vectors[np.maximum(targets, 0)])
  above = np.zeros(len(users), np.int64)
  for start in range(0, len(vectors), _CHUNK):
    above += (users @ vectors[start:start + _CHUNK].T > own[:, None]).sum(axis=1)
  return np.where(present, above, len(vectors))
