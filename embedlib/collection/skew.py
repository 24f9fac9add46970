"""``fit_id_skews``: each table's ``id_skew`` from a batch of real ids.

The planner sizes dedup, and decides whether it pays, from the distinct ids
a data shard holds in a step. Uniform ids (skew 0) repeat least; real ids
repeat more, and how much is a property of the data, so it is measured:
here, once, from a batch the reader yields, and handed to the ``TableSpec``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from embedlib.collection import inputs as inputs_lib
from embedlib.collection.specs import FeatureSpec, TableSpec
from embedlib.plan import cost


def fit_id_skews(tables: Sequence[TableSpec], features: Sequence[FeatureSpec],
                 inputs: Mapping[str, object], *, data_shards: int = 1) -> dict[str, float]:
  """The ``id_skew`` of every table read by ``inputs``, fitted to their distinct ids.

  The batch is split into ``data_shards`` contiguous shards, as a ``batch``
  mesh splits it; in each, a table's id slots (samples times each reading
  feature's ``max_ids_per_sample``, as the planner counts them) and its
  distinct valid ids give a skew (``cost.fit_id_skew``); the smallest over
  the shards is kept, so the planned capacity covers the shard that
  repeats least. Pass the data shards of the mesh you will train on: a
  skew fitted to a shard's batch extrapolates best to it.

  Args:
    tables: the ``TableSpec`` s.
    features: the ``FeatureSpec`` s.
    inputs: feature name -> ids in any form a collection takes (``[batch]``,
      padded ``[batch, bag]``, ``Ragged``); numpy or jax arrays.
    data_shards: data shards of the training mesh (1: the whole batch).

  Returns:
    Table name -> skew, for tables some feature in ``inputs`` reads.

  >>> t = [TableSpec("item", 100_000, 8)]
  >>> f = [FeatureSpec("clicks", "item", max_ids_per_sample=4)]
  >>> ids = np.random.default_rng(0).integers(0, 100_000, (1024, 4))
  >>> fit_id_skews(t, f, {"clicks": ids})   # uniform ids
  {'item': 0.0}
  >>> skew = fit_id_skews(t, f, {"clicks": ids % 500})["item"]   # ids that repeat
  >>> TableSpec("item", 100_000, 8, id_skew=skew).id_skew > 1
  True
  """
  by_name = {t.name: t for t in tables}
  unknown = [k for k in inputs if k not in {f.name for f in features}]
  if unknown:
    raise ValueError(f"fit_id_skews: inputs name feature {unknown[0]!r}, which is not among "
                     f"the features {tuple(f.name for f in features)}.")
  if isinstance(data_shards, bool) or not isinstance(data_shards, (int, np.integer)) or (
      data_shards < 1):
    raise ValueError(f"fit_id_skews: data_shards must be an int >= 1, got {data_shards!r}.")
  bags: dict[str, list[tuple[np.ndarray, int]]] = {}
  for f in features:
    if f.name not in inputs:
      continue
    table = by_name[f.table]
    padded = inputs_lib.to_bags(f, inputs[f.name], None, table.num_embeddings)
    ids = np.asarray(padded.ids)
    bags.setdefault(f.table, []).append((ids, f.max_ids_per_sample or ids.shape[1]))
  out = {}
  for name, parts in bags.items():
    batch = parts[0][0].shape[0]
    if any(ids.shape[0] != batch for ids, _ in parts) or batch < data_shards:
      raise ValueError(
          f"fit_id_skews: table {name!r}'s features need one batch of at least "
          f"data_shards={data_shards} samples each; got batches of "
          f"{[ids.shape[0] for ids, _ in parts]}.")
    skews = []
    for shard in range(data_shards):
      lo, hi = batch * shard // data_shards, batch * (shard + 1) // data_shards
      values = np.concatenate([ids[lo:hi].ravel() for ids, _ in parts])
      distinct = len(np.unique(values[values >= 0]))
      slots = (hi - lo) * sum(bag for _, bag in parts)
      if distinct:
        skews.append(cost.fit_id_skew(slots, distinct, by_name[name].num_embeddings))
    out[name] = min(skews) if skews else 0.0
  return out

