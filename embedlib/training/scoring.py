"""What a served model computes, per task: its named inputs, outputs and scoring function.

``python -m train.export`` serializes ``Scoring.fn`` with ``jax.export``;
``embedlib.serving`` calls it by the names in ``inputs`` and ``outputs``:

- ``ctr``: the click probability of each example (``sigmoid`` of the
  model's logit), from ``dense`` and one id input per sparse feature.
- ``retrieval``: the query tower, then the exact top ``k`` items of the
  precomputed item-tower embeddings (a weight of the artifact).
- ``sequential``: the top ``k`` items of the whole vocabulary after each
  history, optionally leaving out the items in the history.

A MovieLens run on raw ids (``config.data.raw_ids``) serves the file's own
ids: its raw-id inputs (kind ``raw_ids``) are read by the dynamic tables'
maps as they stood after training, without admitting, and the items it
returns are the raw ids of the item table's resident movies, the only ones
its training can rank.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embedlib.collection import EmbeddingCollection
from embedlib.data.movielens_requests import RAW_ID_LIMIT
from embedlib.dynamic import DynamicEmbed, Words
from embedlib.serving import raw_ids
from embedlib.serving.model import DENSE, IDS, RAW_IDS


@dataclasses.dataclass(frozen=True)
class Scoring:
  """A task's serving program.

  Attributes:
    inputs: manifest entries ``{"name", "kind", "dtype", "shape", ...}``
      (``shape`` without the batch); id inputs carry ``num_embeddings``.
    outputs: manifest entries ``{"name", "dtype", "shape"}``.
    fn: ``fn(model, extras, *inputs) -> tuple of outputs``, traced;
      ``extras`` are arrays exported as weights beside the model's.
    extras: named arrays the program reads besides the model's state.
    info: task-specific manifest entries (``top_k``, ``data``).
  """

  inputs: list
  outputs: list
  fn: tp.Callable
  extras: dict = dataclasses.field(default_factory=dict)
  info: dict = dataclasses.field(default_factory=dict)

  def zeros(self, batch_size: int) -> list[np.ndarray]:
    """Example inputs of ``batch_size`` rows (ids ``-1``, the padding id), for tracing."""
    return [raw_ids.padding((batch_size, *s["shape"])) if s["kind"] == RAW_IDS else
            np.full((batch_size, *s["shape"]), -1 if s["kind"] == IDS else 0, s["dtype"])
            for s in self.inputs]


def _ids(name: str, num_embeddings: int, shape=()) -> dict:
  return {"name": name, "kind": IDS, "dtype": "int32", "shape": list(shape),
          "num_embeddings": int(num_embeddings)}


def dynamic_tables(model) -> dict:
  """Every dynamic table of ``model``: ``{table: (path, module)}``.

  ``path`` is the module's ``nnx`` path (its state's names start with it);
  a table tied into two places is found once.
  """
  return {node.name: (tuple(path), node) for path, node in nnx.iter_graph(model)
          if isinstance(node, DynamicEmbed)}


def collection_features(model) -> dict:
  """Each feature of ``model``'s collections read by a dynamic table: ``{feature: module}``."""
  out = {}
  for _, node in nnx.iter_graph(model):
    if isinstance(node, EmbeddingCollection):
      for f in node.feature_specs:
        if f.table in node.dynamic:
          out[f.name] = node.dynamic[f.table]
  return out


def _raw_ids(name: str, table, shape=()) -> dict:
  """A raw-id input of dynamic table ``table``: uint32 words ``shape + (2,)`` in the program."""
  return {"name": name, "kind": RAW_IDS, "dtype": "uint32", "shape": list(shape),
          "table": table.name, "id_dtype": table.id_dtype}


def movie_ids(words: jax.Array) -> jax.Array:
  """Raw-id words ``[..., 2]`` as the int32 raw ids a MovieLens run's tables read.

  ``-1`` is padding; an id outside ``[0, RAW_ID_LIMIT)`` (no training batch
  holds one) becomes ``RAW_ID_LIMIT``, which is never resident, so it
  reads its table's default as any other id without a row.
  """
  hi, lo = words[..., 0], words[..., 1]
  pad_word = jnp.uint32(raw_ids.PAD_WORD)
  pad = (hi == pad_word) & (lo == pad_word)
  fits = (hi == 0) & (lo < jnp.uint32(RAW_ID_LIMIT))
  return jnp.where(pad, -1, jnp.where(fits, lo, RAW_ID_LIMIT).astype(jnp.int32))


def ctr(config, spec, model=None) -> Scoring:
  """Click probabilities ``[B]`` from ``dense [B, num_dense]`` and each feature's ids.

  With raw ids (``config.data.raw_ids``) the features of ``model``'s dynamic
  tables take raw ids (``RAW_IDS``), looked up in the map the artifact
  carries as it stood after training, without admitting (eval mode).
  """
  names = [f.name for f in spec.features]
  dynamic = collection_features(model) if config.data.get("raw_ids", False) else {}
  inputs = [{"name": "dense", "kind": DENSE, "dtype": "float32", "shape": [spec.num_dense]}]
  for f in spec.features:
    shape = () if f.bag_size == 1 else (f.bag_size,)
    inputs.append(_raw_ids(f.name, dynamic[f.name], shape) if f.name in dynamic
                  else _ids(f.name, f.num_embeddings, shape))
  raw = [n in dynamic for n in names]

  def fn(model, extras, dense, *ids):
    del extras
    ids = [Words(x) if r else x for x, r in zip(ids, raw)]
    return (jax.nn.sigmoid(model(dense, dict(zip(names, ids)))),)

  data = {"source": config.data.source, "num_dense": spec.num_dense,
          "raw_ids": bool(dynamic),
          "features": [{"name": f.name, "num_embeddings": f.num_embeddings,
                        "bag_size": f.bag_size} for f in spec.features]}
  return Scoring(inputs, [{"name": "probability", "dtype": "float32", "shape": []}], fn,
                 info={"data": data})


def top_k_outputs(k: int) -> list:
  return [{"name": "items", "dtype": "int32", "shape": [k]},
          {"name": "scores", "dtype": "float32", "shape": [k]}]


def masked_top_k(scores, k: int):
  """``(items, scores)`` of the ``k`` best columns, best first; ``-inf`` columns come last."""
  values, items = jax.lax.top_k(scores, k)
  return items.astype(jnp.int32), values


def _check_k(k: int, n: int, what: str) -> int:
  if not 1 <= k <= n:
    raise ValueError(f"--top_k={k}: must lie in [1, {n}], the {what}.")
  return int(k)


def retrieval(task, model, mesh, eval_source, *, top_k: int) -> Scoring:
  """The query tower, then the exact top ``k`` items of the precomputed item-tower embeddings.

  Inputs are a featurized request (``RetrievalTask.featurize``): the user's
  and the history's hashed rows (``MultiHash``, whose parameters are in the
  manifest's ``data``), the history's authors and actions. Outputs: item ids
  ``[k]`` (``0 .. num_items - 1``) and their scores (cosine similarities),
  best first. The corpus (``task.corpus``, every item through the item
  tower) is a weight: ``[N_padded, features]``, rows past ``num_items``
  never returned.

  On raw ids (``task.dynamic``) the user (where its table is dynamic) and
  the history's movies are raw ids, the corpus is the item table's
  resident movies, and the items returned are their raw ids
  (``corpus_ids``, a weight beside the corpus).
  """
  spec = task.spec
  if task.dynamic:
    corpus, corpus_ids = task.resident_corpus(model, mesh)   # raw ids, RAW_ID_LIMIT pads
    num_items = int((corpus_ids < RAW_ID_LIMIT).sum())
    k = _check_k(top_k, num_items, f"{num_items} resident movies of the item table")
    extras = {"corpus": corpus, "corpus_ids": corpus_ids}
  else:
    num_items = spec.num_items
    k = _check_k(top_k, num_items, f"{num_items} items")
    extras = {"corpus": task.corpus(model, mesh, eval_source.catalogue())}  # rows split
  hashers = {name: h for name, h in (("user", task.user_hasher), ("item", task.item_hasher))
             if h is not None}

  def id_input(name, hasher, shape):
    if hasher is None:  # a dynamic table: the raw ids themselves
      return _raw_ids(name, model.user_tower.user if name == "user" else model.items, shape)
    return _ids(name, hasher.num_buckets, (*shape, hasher.num_hashes))

  inputs = [
      id_input("user", task.user_hasher, ()),
      id_input("history_item", task.item_hasher, (spec.history_len,)),
      _ids("history_author", model.authors.num_embeddings, (spec.history_len,)),
      {"name": "history_actions", "kind": DENSE, "dtype": "float32",
       "shape": [spec.history_len, spec.num_actions]},
  ]
  names = [s["name"] for s in inputs]
  raw = [s["kind"] == RAW_IDS for s in inputs]

  def fn(model, extras, *columns):
    columns = [movie_ids(c) if r else c for c, r in zip(columns, raw)]
    users = model.users(dict(zip(names, columns)))
    scores = users @ extras["corpus"].T
    if "corpus_ids" in extras:
      ids = extras["corpus_ids"]
      items, values = masked_top_k(jnp.where(ids < RAW_ID_LIMIT, scores, -jnp.inf), k)
      return ids[items], values
    scores = jnp.where(jnp.arange(scores.shape[1]) < num_items, scores, -jnp.inf)
    return masked_top_k(scores, k)

  data = {"num_items": num_items, "raw_ids": bool(task.dynamic),
          "hashers": {name: {"num_buckets": h.num_buckets, "num_hashes": h.num_hashes,
                             "seed": h.seed} for name, h in hashers.items()}}
  return Scoring(inputs, top_k_outputs(k), fn, extras=extras, info={"top_k": k, "data": data})


def sequential(config, spec, *, top_k: int, exclude_input: bool, model=None) -> Scoring:
  """Top ``k`` items of the whole vocabulary after each history (SASRec, HSTU).

  Inputs: ``items`` int ``[max_len]``, the history oldest first, right-aligned
  with ``0`` (padding) before it; HSTU also takes ``times`` and
  ``query_times`` ``[max_len]`` (int32 seconds from any common origin: each
  item's time, and the time the position after it is predicted for, the
  last being the request's). Outputs: item ids
  ``[k]`` in ``1 .. num_items`` and their logits, best first; with
  ``exclude_input`` a history's own items are left out.

  On raw ids (``config.data.raw_ids``; ``model`` is then the trained model,
  whose item table is dynamic) ``items`` are the file's movie ids, padded
  with ``-1``, and the items returned are the raw ids of the table's
  resident movies (``-1`` where fewer than ``k`` are left to return).
  """
  raw = bool(config.data.get("raw_ids", False))
  if raw:
    table = model.items
    num_items = len(table.resident())
    k = _check_k(top_k, num_items, f"{num_items} resident movies of the item table")
    inputs = [_raw_ids("items", table, (spec.max_len,))]
  else:
    num_items = spec.num_items
    k = _check_k(top_k, num_items, f"{num_items} items")
    inputs = [_ids("items", spec.vocab_size, (spec.max_len,))]
  if config.model.name == "hstu":
    inputs += [{"name": "times", "kind": DENSE, "dtype": "int32", "shape": [spec.max_len]},
               {"name": "query_times", "kind": DENSE, "dtype": "int32", "shape": [spec.max_len]}]
  names = [s["name"] for s in inputs]

  def fn(model, extras, *columns):
    del extras
    batch = dict(zip(names, columns))
    if raw:  # indices: a resident movie's row + 1, 0 for padding or a movie without a row
      batch = model.to_rows(dict(batch, items=movie_ids(batch["items"])))
    scores = model.logits(model(batch)[:, -1], batch["items"])
    if raw:  # column r is row r; a row that holds no movie is never returned
      resident = model.items.score[...] >= 0
      scores = jnp.where(resident, scores, -jnp.inf)
      items = batch["items"] - 1
    else:    # column 0 pads
      scores = jnp.where(jnp.arange(scores.shape[1]) > 0, scores, -jnp.inf)
      items = batch["items"]
    if exclude_input:
      vocab = scores.shape[1]
      rows = jnp.arange(items.shape[0])[:, None]
      # Out-of-range indices (the padding, mapped to ``vocab``) are dropped.
      scores = scores.at[rows, jnp.where(items >= int(not raw), items, vocab)].set(
          -jnp.inf, mode="drop")
    top, values = masked_top_k(scores, k)
    if raw:
      ids = jnp.where(resident, model.items.keys_lo[...].astype(jnp.int32), -1)
      top = jnp.where(values > -jnp.inf, ids[top], -1)
    return top, values

  return Scoring(inputs, top_k_outputs(k), fn,
                 info={"top_k": k, "exclude_input": bool(exclude_input),
                       "data": {"num_items": num_items, "max_len": spec.max_len,
                                "raw_ids": raw}})


#: The input name of a weighted list column's weights.
WEIGHTS_SUFFIX = ":weights"


def tabular(task, model) -> Scoring:
  """A tabular run's rows scored: click probabilities, or the two towers' scores.

  Inputs are a featurized row of the run's schema (``embedlib.tabular``;
  ``embedlib.serving.tabular`` makes them from a file's columns): ``dense``
  (the dense columns, transformed), one input per id column (rows of a
  vocabulary or hashed table, or raw ids of a dynamic one; lists as
  ``[max_len]``, -1 padded) and ``<list>:weights`` for weighted lists.
  Outputs: ``probability`` (``[K]`` for K labels), or for the two towers
  ``score``, the user and item towers' dot product over the temperature.
  The schema and statistics go into the manifest (``data``), so a server
  reads a file's columns as the run did.
  """
  import json  # pylint: disable=g-import-not-at-top

  from embedlib.models import tabular as tabular_models  # pylint: disable=g-import-not-at-top
  from embedlib.tabular import schema as schema_lib  # pylint: disable=g-import-not-at-top

  prepared = task.prepared
  schema = prepared.schema
  dynamic = collection_features(model)
  inputs = [{"name": "dense", "kind": DENSE, "dtype": "float32",
             "shape": [len(schema.dense())]}]
  names, weighted = list(schema.features()), []
  for name in names:
    c = schema[name]
    shape = (c.max_len,) if c.role == schema_lib.LIST else ()
    inputs.append(_raw_ids(name, dynamic[name], shape) if name in dynamic
                  else _ids(name, c.num_embeddings, shape))
  for name in names:
    if schema[name].weights:
      weighted.append(name)
      inputs.append({"name": name + WEIGHTS_SUFFIX, "kind": DENSE, "dtype": "float32",
                     "shape": [schema[name].max_len]})
  raw = [n in dynamic for n in names]
  two_tower = task.model_name == tabular_models.TWO_TOWER

  def fn(model, extras, dense, *rest):
    del extras
    ids = [Words(x) if r else x for x, r in zip(rest[:len(names)], raw)]
    sparse, weights = dict(zip(names, ids)), dict(zip(weighted, rest[len(names):]))
    if two_tower:
      users, items = model.towers(dense, sparse, weights)
      return (jnp.sum(users * items, axis=-1) / model.temperature(),)
    return (jax.nn.sigmoid(model(dense, sparse, weights)),)

  labels = schema.labels()
  if two_tower:
    outputs = [{"name": "score", "dtype": "float32", "shape": []}]
  else:
    outputs = [{"name": "probability", "dtype": "float32",
                "shape": [] if len(labels) == 1 else [len(labels)]}]
  data = {"source": "tabular", "schema": json.loads(schema.to_json()),
          "statistics": json.loads(prepared.statistics), "labels": list(labels),
          "label_threshold": prepared.label_threshold, "format": prepared.files.format,
          "delimiter": prepared.files.delimiter, "list_separator": prepared.separator}
  return Scoring(inputs, outputs, fn, info={"data": data})
