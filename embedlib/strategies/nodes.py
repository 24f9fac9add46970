"""The two-level route: inside each node first, then across nodes, each row once per node pair.

A routed lookup over a group spanning ``plan.nodes`` nodes of
``plan.devices_per_node`` ranks (``plan.node_route``; the group's rank
``n * devices_per_node + l`` is rank ``l`` of node ``n``). The flat route's
one ``all_to_all`` over the group becomes two, each over sub-groups of it:
``within_node`` (the ranks of one node) and ``across_nodes`` (the ranks of
one local index, one per node). Between them each rank deduplicates the
ids its node sends one destination, so an id asked by several ranks of a
node crosses between two nodes once, and its row comes back once (see
``strategies.routed`` for the steps, ``optim.route`` for the row
gradients, which sum per id inside the node before crossing).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from embedlib.strategies import unique


class NodeSent(NamedTuple):
  """What the two-level route's ids step leaves for its rows step (``send_ids``).

  Attributes:
    ids: int32 ``[group * capacity]``, the owner-local rows asked of this
      rank, ``-1`` in empty slots, by asking node.
    inverse: int32 ``[nodes, devices_per_node * capacity]``: per
      destination node, each id's place among the distinct ids this rank
      sent it (``-1`` for none).
    crowded: bool scalar: some node held more distinct ids for one
      destination than the node capacity, and this step crossed with the
      flat route's buffers.
  """

  ids: jax.Array
  inverse: jax.Array
  crowded: jax.Array


def within_node(x, plan):
  """``all_to_all`` of ``x``'s leading dimension among the ranks of this rank's node."""
  per = plan.devices_per_node
  if per == 1:
    return x
  groups = [[n * per + k for k in range(per)] for n in range(plan.nodes)]
  return lax.all_to_all(x, plan.table_axes, 0, 0, tiled=True, axis_index_groups=groups)


def across_nodes(x, plan):
  """``all_to_all`` of ``x``'s leading dimension among the ranks of this local index."""
  per = plan.devices_per_node
  groups = [[m * per + k for m in range(plan.nodes)] for k in range(per)]
  return lax.all_to_all(x, plan.table_axes, 0, 0, tiled=True, axis_index_groups=groups)


def send_ids(send, plan):
  """The ids' two exchanges: inside the node, then each distinct id across.

  1a. ``within_node``: rank ``l`` of the node gets every id its node's
      ranks send to rank ``l`` of any node;
  1b. those ids are deduplicated per destination (at most
      ``plan.node_capacity_for(capacity)`` each) and ``across_nodes`` takes
      them to their owners. A step with more distinct ids for one
      destination, anywhere in the group, sends every id across instead
      (``crowded``): the flat route's bytes, the same rows.

  Args:
    send: int32 ``[group * capacity]`` from ``unique.bucketize``.
    plan: the table's ``EmbeddingPlan`` (``plan.node_route``).

  Returns:
    A ``NodeSent``: the ids to look up here and what ``rows_back`` needs.
  """
  n_nodes, per = plan.nodes, plan.devices_per_node
  capacity = send.shape[0] // plan.group_size
  cap = plan.node_capacity_for(capacity)
  # [destination local index, destination node, slot]: rank l of the node
  # gets block l, the ids of every rank of the node for local index l.
  x = within_node(send.reshape(n_nodes, per, capacity).transpose(1, 0, 2), plan)
  x = x.transpose(1, 0, 2).reshape(n_nodes, per * capacity)  # per destination node
  firsts, inverse, count = jax.vmap(lambda i: unique.unique_with_inverse(i, cap))(x)
  crowded = lax.pmax(jnp.max(count), plan.table_axes) > cap

  def distinct():
    got = across_nodes(firsts, plan)
    return jnp.pad(got, ((0, 0), (0, per * capacity - cap)), constant_values=-1)

  ids = lax.cond(crowded, lambda: across_nodes(x, plan), distinct)
  return NodeSent(ids.reshape(-1), inverse, crowded)


def rows_back(rows, sent, plan):
  """The rows' way back: across nodes, expanded to the ids that asked, then inside the node.

  Args:
    rows: ``[group * capacity, features]``, the rows of ``sent.ids``.
    sent: what ``send_ids`` returned.
    plan: the table's ``EmbeddingPlan``.

  Returns:
    ``[group * capacity, features]``: in each slot of the asking rank's
    send buffer, the row of the id that left from it (as the flat route).
  """
  n_nodes, per = plan.nodes, plan.devices_per_node
  capacity = rows.shape[0] // plan.group_size
  cap = plan.node_capacity_for(capacity)
  rows = rows.reshape(n_nodes, per * capacity, rows.shape[-1])

  def distinct():
    got = across_nodes(rows[:, :cap], plan)
    expand = lambda r, i: jnp.where((i >= 0)[:, None],
                                    jnp.take(r, jnp.maximum(i, 0), axis=0, mode="clip"), 0)
    return jax.vmap(expand)(got, sent.inverse).astype(rows.dtype)

  back = lax.cond(sent.crowded, lambda: across_nodes(rows, plan), distinct)
  back = back.reshape(n_nodes, per, capacity, -1).transpose(1, 0, 2, 3)
  back = within_node(back, plan)  # [destination local index, destination node, slot]
  return back.transpose(1, 0, 2, 3).reshape(plan.group_size * capacity, -1)
