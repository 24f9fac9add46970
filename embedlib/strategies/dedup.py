"""Id dedup with a static capacity: look each distinct id up once per data shard.

Every data shard sorts its own ids (all requests of one table, bags side by
side) and keeps at most ``capacity`` distinct valid ids plus the inverse
index of each id. Only the unique ids enter the table's lookup, so the
token-sharded layouts communicate ``capacity`` ids and rows per shard
instead of one per id; the batch is rebuilt on the shard that owns it, and
pooled requests are pooled there with the ``bag`` kernel reading the unique
rows (no ``[batch, bag, features]`` intermediate).

A lookup is ``distribute`` (the distinct ids and the inverse index) then
``finish`` (the distinct ids' rows, the batch rebuilt from them); the
distinct ids' own lookup is the table's (``lookup_unique``), in line or
from its distribution made ahead.

Overflow (more distinct ids in one shard than ``capacity``) is never
silently wrong: ``finish`` either falls back to the lookup without
dedup (``lax.cond``) or returns the count for the caller to check with
``check_capacity``, which raises naming the table and the capacity it needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from embedlib import options
from embedlib import sharding as sharding_lib
from embedlib import kernels
from embedlib.strategies import runner
from embedlib.strategies import unique as unique_lib


def unique_per_shard(ids, capacity: int, *, plan, mesh):
  """``unique_with_inverse`` on each data shard of padded ``ids``.

  Args:
    ids: int32 ``[batch, width]`` with batch a multiple of the data shards.
    capacity: unique slots per data shard.
    plan: the table's ``EmbeddingPlan`` (for its data axes).
    mesh: the mesh, or None.

  Returns:
    ``(unique [shards * capacity], inverse [batch, width] indexing this
    shard's block, counts [shards])``, all split over the data axes.
  """

  def body(local):
    unique, inverse, count = unique_lib.unique_with_inverse(local, capacity)
    return unique, inverse, count[None]

  return runner.per_shard(body, (ids,), plan=plan, mesh=mesh)


def rebuild(rows, inverse, coefs, *, plan, mesh, gather, bag, check_vma=True):
  """Each shard's features from its unique rows.

  Args:
    rows: ``[shards * capacity, features]``, split over the data axes.
    inverse: per feature, int32 ``[batch, bag]`` indices into the shard's
      block of ``rows`` (``-1`` for padding).
    coefs: per feature, float ``[batch, bag]`` pooling factors (from
      ``bag_coefficients``), or None for a sequence feature.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh, or None.
    gather: local row kernel.
    bag: local pooled kernel.
    check_vma: shard_map's type check (off for the Pallas interpreter).

  Returns:
    Per feature, ``[batch, features]`` (pooled) or ``[batch, bag, features]``.
  """
  pooled = tuple(c is not None for c in coefs)
  coefs = tuple(c for c in coefs if c is not None)

  def body(local_rows, inverse, coefs):
    coefs = iter(coefs)
    return tuple(
        bag(local_rows, inv, next(coefs), combiner="sum") if p else gather(local_rows, inv)
        for inv, p in zip(inverse, pooled)
    )

  return runner.per_shard(
      body, (rows, tuple(inverse), coefs), plan=plan, mesh=mesh, check_vma=check_vma
  )


FALLBACK = options.FALLBACK
ERROR = options.ERROR
OVERFLOW_MODES = options.ON_OVERFLOW


def as_2d(ids):
  """``[batch]`` ids as ``[batch, 1]``; ``[batch, bag]`` unchanged."""
  return ids[:, None] if ids.ndim == 1 else ids


def distribute(requests, *, plan, mesh, capacity: int):
  """Each data shard's distinct ids over all ``requests``, and each id's place among them.

  Args:
    requests: ``Request`` s of the table, ids ``[batch]`` or ``[batch, bag]``
      sharing the batch.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh, or None.
    capacity: distinct ids per data shard.

  Returns:
    ``{"unique": [shards * capacity], "inverse": [padded batch, widths],
    "counts": [shards]}`` (``unique_per_shard``). A caller that distributes
    ahead adds ``"rows"``: the distribution of the distinct ids' own lookup.
  """
  ids = sharding_lib.pad_tokens(
      jnp.concatenate([as_2d(r.ids) for r in requests], axis=1), plan.data_shards, -1
  )
  unique, inverse, counts = unique_per_shard(ids, capacity, plan=plan, mesh=mesh)
  return {"unique": unique, "inverse": inverse, "counts": counts}


def finish(table, requests, state, *, plan, mesh, gather, bag, capacity: int,
           lookup_unique, lookup_all, on_overflow: str = FALLBACK, check_vma=True):
  """The requests' outputs from one lookup of each shard's distinct ids.

  Args:
    table: the physical table, ``plan.padded_shape``.
    requests: as ``distribute`` took them.
    state: ``distribute``'s.
    plan: the table's ``EmbeddingPlan``.
    mesh: the mesh, or None.
    gather: local row kernel.
    bag: local pooled kernel.
    capacity: distinct ids per data shard.
    lookup_unique: ``(table, state) -> [shards * capacity, features]``, the
      rows of ``state["unique"]``.
    lookup_all: ``(table) -> outputs``, the requests looked up without
      dedup (a shard holding more distinct ids than ``capacity``).
    on_overflow: ``"fallback"``: a shard holding more distinct ids than
      ``capacity`` takes ``lookup_all`` (``lax.cond``, same result);
      ``"error"``: the caller checks the returned count.
    check_vma: shard_map's type check (off for the Pallas interpreter).

  Returns:
    ``(outputs, need)``: one output per request, as ``lookup_all`` gives
    them, and the most distinct ids any shard held (int32 scalar).
  """
  batch = requests[0].ids.shape[0]
  need = jnp.max(state["counts"])
  coefs = coefficients(requests, plan)
  widths = [as_2d(r.ids).shape[1] for r in requests]
  # Each output takes its own ids' batch split, as without dedup: the two
  # lax.cond branches must agree when features arrive split differently.
  specs = [sharding_lib.leading_spec(r.ids, mesh) if mesh is not None else None
           for r in requests]

  def with_dedup(table, carried, coefs):
    unique, inverse, ahead = carried
    rows = lookup_unique(table, {"unique": unique, "rows": ahead})
    parts = jnp.split(inverse, np.cumsum(widths)[:-1], axis=1)
    parts = [p[:, 0] if r.ids.ndim == 1 else p for p, r in zip(parts, requests)]
    out = rebuild(rows, parts, coefs, plan=plan, mesh=mesh, gather=gather, bag=bag,
                  check_vma=check_vma)
    return tuple(runner.restore(o, batch, spec, mesh=mesh) for o, spec in zip(out, specs))

  def without_dedup(table, carried, coefs):
    del carried, coefs
    return lookup_all(table)

  # What the branches read: the counts were read above.
  carried = (state["unique"], state["inverse"], state.get("rows"))
  if on_overflow == ERROR:
    return with_dedup(table, carried, coefs), need
  return lax.cond(need > capacity, without_dedup, with_dedup, table, carried, coefs), need


def coefficients(requests, plan):
  """Each pooled request's bag coefficients over the logical rows, padded as its tokens.

  None for a request that is not pooled.
  """
  return tuple(
      sharding_lib.pad_tokens(
          kernels.bag_coefficients(r.ids, r.weights, plan.num_embeddings, r.combiner),
          plan.data_shards, 0,
      ) if r.pooled else None
      for r in requests
  )


_WHAT = {
    "num_unique": "a data shard holds {need} distinct ids, more than num_unique={cap}",
    "route_capacity": "a rank sends {need} ids to one owner, more than route_capacity={cap}",
}


def check_capacity(need, capacity: int, name: str, what: str = "num_unique") -> None:
  """Raises (or, traced, checks with ``checkify``) that ``need <= capacity``.

  Args:
    need: the count a step needed (int32 scalar, concrete or traced).
    capacity: the static capacity it had.
    name: the table, for the message.
    what: ``"num_unique"`` (dedup) or ``"route_capacity"`` (routed lookup).
  """
  or_fallback = (
      "or on_overflow='fallback' to look such batches up without dedup"
      if what == "num_unique" else
      "or on_overflow='fallback' to look such batches up by the vocab path"
  )
  if isinstance(need, jax.core.Tracer):
    checkify.check(
        need <= capacity,
        f"table {name!r}: " + _WHAT[what].format(need="{need}", cap=capacity)
        + f"; pass {what}={{{{{name!r}: N}}}} with N at least that count, {or_fallback}.",
        need=need,
    )
    return
  if int(need) > int(capacity):
    raise ValueError(
        f"table {name!r}: " + _WHAT[what].format(need=int(need), cap=int(capacity))
        + f"; pass {what}={{{name!r}: {int(need)}}} (or more), {or_fallback}."
    )
