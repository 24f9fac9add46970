"""What a served model computes, per task: its named inputs, outputs and scoring function.

``python -m train.export`` serializes ``Scoring.fn`` with ``jax.export``;
``embedlib.serving`` calls it by the names in ``inputs`` and ``outputs``:

- ``ctr``: the click probability of each example (``sigmoid`` of the
  model's logit), from ``dense`` and one id input per sparse feature.
- ``retrieval``: the query tower, then the exact top ``k`` items of the
  precomputed item-tower embeddings (a weight of the artifact).
- ``sequential``: the top ``k`` items of the whole vocabulary after each
  history, optionally leaving out the items in the history.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embedlib.collection import EmbeddingCollection
from embedlib.dynamic import Words
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
  """Every dynamic table of ``model``'s collections: ``{table: (path, module, features)}``.

  ``path`` is the module's ``nnx`` path (its state's names start with it),
  ``features`` the names of the features that read it.
  """
  out = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, EmbeddingCollection):
      for name, table in node.dynamic.items():
        features = [f.name for f in node.feature_specs if f.table == name]
        out[name] = ((*path, "dynamic", name), table, features)
  return out


def _raw_ids(name: str, table, shape=()) -> dict:
  """A raw-id input of dynamic table ``table``: uint32 words ``shape + (2,)`` in the program."""
  return {"name": name, "kind": RAW_IDS, "dtype": "uint32", "shape": list(shape),
          "table": table.name, "id_dtype": table.id_dtype}


def ctr(config, spec, model=None) -> Scoring:
  """Click probabilities ``[B]`` from ``dense [B, num_dense]`` and each feature's ids.

  With raw ids (``config.data.raw_ids``) the features of ``model``'s dynamic
  tables take raw ids (``RAW_IDS``), looked up in the map the artifact
  carries as it stood after training, without admitting (eval mode).
  """
  names = [f.name for f in spec.features]
  dynamic = {}
  if config.data.get("raw_ids", False):
    dynamic = {f: module for _, module, features in dynamic_tables(model).values()
               for f in features}
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
  """
  spec = task.spec
  num_items = spec.num_items
  k = _check_k(top_k, num_items, f"{num_items} items")
  corpus = task.corpus(model, mesh, eval_source.catalogue())  # rows split over the mesh
  user_rows, item_rows = task.user_hasher.num_buckets, task.item_hasher.num_buckets
  hashes_u, hashes_i = task.user_hasher.num_hashes, task.item_hasher.num_hashes
  inputs = [
      _ids("user", user_rows, (hashes_u,)),
      _ids("history_item", item_rows, (spec.history_len, hashes_i)),
      _ids("history_author", model.authors.num_embeddings, (spec.history_len,)),
      {"name": "history_actions", "kind": DENSE, "dtype": "float32",
       "shape": [spec.history_len, spec.num_actions]},
  ]
  names = [s["name"] for s in inputs]

  def fn(model, extras, *columns):
    users = model.users(dict(zip(names, columns)))
    scores = users @ extras["corpus"].T
    scores = jnp.where(jnp.arange(scores.shape[1]) < num_items, scores, -jnp.inf)
    return masked_top_k(scores, k)

  hashers = {name: {"num_buckets": h.num_buckets, "num_hashes": h.num_hashes, "seed": h.seed}
             for name, h in (("user", task.user_hasher), ("item", task.item_hasher))}
  return Scoring(inputs, top_k_outputs(k), fn, extras={"corpus": corpus},
                 info={"top_k": k, "data": {"num_items": num_items, "hashers": hashers}})


def sequential(config, spec, *, top_k: int, exclude_input: bool) -> Scoring:
  """Top ``k`` items of the whole vocabulary after each history (SASRec, HSTU).

  Inputs: ``items`` int ``[max_len]``, the history oldest first, right-aligned
  with ``0`` (padding) before it; HSTU also takes ``times`` and
  ``query_times`` ``[max_len]`` (int32 seconds from any common origin: each
  item's time, and the time the position after it is predicted for, the
  last being the request's). Outputs: item ids
  ``[k]`` in ``1 .. num_items`` and their logits, best first; with
  ``exclude_input`` a history's own items are left out.
  """
  k = _check_k(top_k, spec.num_items, f"{spec.num_items} items")
  inputs = [_ids("items", spec.vocab_size, (spec.max_len,))]
  if config.model.name == "hstu":
    inputs += [{"name": "times", "kind": DENSE, "dtype": "int32", "shape": [spec.max_len]},
               {"name": "query_times", "kind": DENSE, "dtype": "int32", "shape": [spec.max_len]}]
  names = [s["name"] for s in inputs]

  def fn(model, extras, *columns):
    del extras
    batch = dict(zip(names, columns))
    scores = model.logits(model(batch)[:, -1], batch["items"])
    vocab = scores.shape[1]
    scores = jnp.where(jnp.arange(vocab) > 0, scores, -jnp.inf)  # row 0 pads
    if exclude_input:
      items = batch["items"]
      rows = jnp.arange(items.shape[0])[:, None]
      # Out-of-range indices (the padding, mapped to ``vocab``) are dropped.
      scores = scores.at[rows, jnp.where(items > 0, items, vocab)].set(-jnp.inf, mode="drop")
    return masked_top_k(scores, k)

  return Scoring(inputs, top_k_outputs(k), fn,
                 info={"top_k": k, "exclude_input": bool(exclude_input),
                       "data": {"num_items": spec.num_items, "max_len": spec.max_len}})
