"""A collection step's bytes per device: what the planner weighs.

``estimate_bytes_moved`` counts a table's lookup traffic feature by feature
(a pooled feature moves its ids and one pooled row per sample, a sequence
feature a row per id, a deduplicated table a row per distinct id);
``weighed`` adds the sparse update's and counts a byte across nodes
``cost.INTER_NODE_WEIGHT`` times; ``dedup_if_it_pays`` is ``num_unique="auto"``
for a table of its own. Pure Python: no arrays.
"""

from __future__ import annotations

import math

from embedlib import options
from embedlib.plan import EmbeddingPlan, cost, mesh_axes


def _ranks(plan: EmbeddingPlan) -> tuple[int, int]:
  token = mesh_axes.axes_size(dict(plan.mesh_shape), plan.token_axes)
  return token, plan.group_size // token


def _column_ranks(plan: EmbeddingPlan) -> tuple[int, int]:
  """A grid's column token and rest ranks; ``(1, 1)`` for the 1-D layouts."""
  token = mesh_axes.axes_size(dict(plan.mesh_shape), plan.column_token_axes)
  return token, plan.column_group_size // token


def _ids_bytes(plan: EmbeddingPlan, n: int) -> int:
  """Ids all-gathered over the token ranks (a grid's column ones first)."""
  token_ranks, _ = _ranks(plan)
  column_token_ranks, _ = _column_ranks(plan)
  local = math.ceil(n / plan.data_shards)
  return (column_token_ranks * token_ranks - 1) * local * cost.ID_BYTES


def _gather_bytes(plan: EmbeddingPlan, n: int) -> int:
  """Ids in and one row per id out, for ``n`` ids over the mesh."""
  if plan.strategy == options.REPLICATED:
    return 0
  token_ranks, rest_ranks = _ranks(plan)
  column_token_ranks, column_rest_ranks = _column_ranks(plan)
  per_device = math.ceil(n / plan.data_shards)
  if plan.strategy == options.ROUTED and plan.nodes > 1:
    return sum(plan.node_bytes(per_device))  # the two-level route's, or the flat one's split
  return cost.bytes_moved_per_lookup(
      plan.padded_shape,
      plan.strategy,
      ids_per_device=per_device,
      token_ranks=token_ranks,
      rest_ranks=rest_ranks,
      itemsize=plan.itemsize,
      capacity=plan.capacity_for(per_device) if plan.strategy == options.ROUTED else None,
      column_token_ranks=column_token_ranks,
      column_rest_ranks=column_rest_ranks,
  )


def estimate_bytes_moved(plan, bags, *, batch_size, num_unique=None) -> int:
  """Bytes one device receives per step for the features reading a table.

  Args:
    plan: the table's ``EmbeddingPlan``.
    bags: ``(bag, pooled)`` per feature: ids per sample and whether the
      feature is pooled (else a sequence feature).
    batch_size: samples per step over the whole mesh.
    num_unique: dedup capacity per data shard, or None without dedup.

  Returns:
    The estimate, in bytes (0 for a replicated table).

  >>> from embedlib.plan import plan_embedding
  >>> p = plan_embedding(1 << 20, 64, mesh={"batch": 8}, sharding="vocab")
  >>> estimate_bytes_moved(p, [(8, True)], batch_size=1024)  # ids + pooled rows
  258048
  >>> estimate_bytes_moved(p, [(8, False)], batch_size=1024)  # ids + a row per id
  1863680
  >>> estimate_bytes_moved(p, [(8, False)], batch_size=1024, num_unique=512)
  931840
  >>> r = plan_embedding(1 << 20, 64, mesh={"batch": 8}, sharding="routed")
  >>> estimate_bytes_moved(r, [(8, False)], batch_size=1024)  # 1024 ids a rank, to owners
  311227

  Dedup pays when a shard's unique ids are fewer than the rows it would
  otherwise receive: for pooled features, fewer than its samples.
  """
  if plan.strategy == options.REPLICATED:
    return 0
  if num_unique is not None:
    # One lookup of each shard's unique ids; pooling happens after, locally.
    return _gather_bytes(plan, num_unique * plan.data_shards)
  if plan.strategy == options.ROUTED:
    # Every feature's ids in one route, a row back for each (pooled after).
    local = math.ceil(batch_size / plan.data_shards)
    return _gather_bytes(plan, plan.data_shards * local * sum(b for b, _ in bags))
  moved = 0
  for bag, pooled in bags:
    ids = batch_size * bag
    if pooled:
      # Ids travel, then one pooled row per sample (no row per id).
      moved += _ids_bytes(plan, ids) + _gather_bytes(plan, batch_size) - _ids_bytes(plan, batch_size)
    else:
      moved += _gather_bytes(plan, ids)
  return moved


def node_split(plan: EmbeddingPlan, moved: int) -> tuple[int, int]:
  """``(intra-node, inter-node)`` of ``moved``, a step's lookup bytes per device.

  A routed table's (or stack's) lookup bytes are its plan's node split
  already (``_gather_bytes``); ``EmbeddingPlan.node_bytes`` gives their
  inter-node part at the ids that moved them, so the estimate is split by
  that share. Any other layout's group collective splits by
  ``cost.inter_node_share``. ``(moved, 0)`` on one node.
  """
  if plan.nodes == 1 or not moved:
    return moved, 0
  if plan.strategy == options.ROUTED:
    intra, inter = plan.node_bytes()
    share = inter / max(intra + inter, 1)
  else:
    share = cost.inter_node_share(plan.group_size, plan.devices_per_node)
  inter = int(moved * share)
  return moved - inter, inter


def weighed(plan: EmbeddingPlan, lookup: int, ids: int) -> tuple[int, int]:
  """A step's ``(lookup, sparse update)`` bytes, a byte across nodes counted ``INTER_NODE_WEIGHT``x.

  As ``plan_embedding``'s ``auto`` weighs a lookup's. The update's route
  splits by ``EmbeddingPlan.update_node_bytes``; its all-gather or
  all-reduce over the data shards as a group collective over them
  (``cost.inter_node_share``, nodes of ``devices_per_node`` data ranks).
  """
  if not plan.devices_per_node:
    return lookup, plan.sparse_update(ids)[1]
  intra, inter = node_split(plan, lookup)
  u_intra, u_inter = update_node_split(plan, ids)
  weight = cost.INTER_NODE_WEIGHT
  return intra + weight * inter, u_intra + weight * u_inter


def update_node_split(plan: EmbeddingPlan, ids: int) -> tuple[int, int]:
  """``(intra-node, inter-node)`` bytes of a step's sparse update, ``ids`` ids per device.

  The route's (``EmbeddingPlan.update_node_bytes``); an all-gather's or
  all-reduce's over the data shards (nodes of ``devices_per_node`` data
  ranks), as every group collective's (``cost.inter_node_share``).
  """
  way, update = plan.sparse_update(ids)
  if way == "route":
    return plan.update_node_bytes(ids)
  inter = int(update * cost.inter_node_share(plan.data_shards, plan.devices_per_node))
  return update - inter, inter


def dedup_if_it_pays(plan, bags, *, batch_size: int, local_batch: int) -> int | None:
  """``num_unique="auto"`` for a table of its own: a capacity, or None (no dedup).

  A sharded table dedups when looking up the expected distinct ids (for
  ids of the plan's ``id_skew``, with the route's slack:
  ``cost.dedup_capacity``) saves more bytes than dedup's own work on the
  ids costs (``cost.dedup_pays``), a byte across nodes weighed as for the
  layout. A pooled feature on vocab or hidden rows moves one row per
  sample, so there dedup rarely pays; a routed table's or a sequence
  feature's lookup moves a row per id, and repeats are saved bytes.
  """
  if plan.strategy == options.REPLICATED or plan.group_size < 2:
    return None
  ids = local_batch * sum(b for b, _ in bags)
  capacity = cost.dedup_capacity([(ids, plan.num_embeddings, plan.id_skew)])
  with_dedup = estimate_bytes_moved(plan, bags, batch_size=batch_size, num_unique=capacity)
  without = estimate_bytes_moved(plan, bags, batch_size=batch_size)
  lookup = lambda moved: weighed(plan, moved, max(ids, 1))[0]
  return capacity if cost.dedup_pays(lookup(without), lookup(with_dedup), ids) else None
