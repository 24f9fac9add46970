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

from embedlib.serving.model import DENSE, IDS


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
    return [np.full((batch_size, *s["shape"]), -1 if s["kind"] == IDS else 0, s["dtype"])
            for s in self.inputs]


def _ids(name: str, num_embeddings: int, shape=()) -> dict:
  return {"name": name, "kind": IDS, "dtype": "int32", "shape": list(shape),
          "num_embeddings": int(num_embeddings)}


def ctr(config, spec) -> Scoring:
  """Click probabilities ``[B]`` from ``dense [B, num_dense]`` and each feature's ids."""
  names = [f.name for f in spec.features]
  inputs = [{"name": "dense", "kind": DENSE, "dtype": "float32", "shape": [spec.num_dense]}]
  inputs += [_ids(f.name, f.num_embeddings, () if f.bag_size == 1 else (f.bag_size,))
             for f in spec.features]

  def fn(model, extras, dense, *ids):
    del extras
    return (jax.nn.sigmoid(model(dense, dict(zip(names, ids)))),)

  data = {"source": config.data.source, "num_dense": spec.num_dense,
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
