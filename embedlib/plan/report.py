"""A plan in words: the printed ``EmbeddingPlan`` and byte counts for people.

Reads a plan's fields, layout and traffic; decides nothing.
"""

from __future__ import annotations

import textwrap

from embedlib import options

#: Columns a printed plan fits in, and where its field values start.
PRINT_WIDTH, VALUE_COLUMN = 100, 18


def human_bytes(n: int) -> str:
  """``n`` bytes in B, KiB, MiB or GiB, as plans and planners print them.

  >>> human_bytes(1000), human_bytes(196 * 1024), human_bytes(3 << 30)
  ('1000 B', '196.00 KiB', '3.00 GiB')
  """
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return str(n)


def describe(plan) -> str:
  """``str(plan)``: one field a line; a line past 100 columns wraps under its field's value."""
  mesh = ", ".join(f"{a}={n}" for a, n in plan.mesh_shape) or "one device"
  lines = [
      f"EmbeddingPlan({plan.name}: {plan.num_embeddings} x {plan.features})",
      f"  strategy        {plan.strategy}",
      f"  mesh            {mesh}",
      f"  table_axes      {plan.table_axes}  (token_axes {plan.token_axes})",
      *([f"  column_axes     {plan.column_axes}  (token_axes "
         f"{plan.column_token_axes})"] if plan.strategy == options.GRID else []),
      f"  data_axes       {plan.data_axes}",
      f"  padded shape    {plan.padded_shape[0]} x {plan.padded_shape[1]}"
      f"  (+{100 * plan.padding_overhead:.2f}% padding)",
      f"  shard shape     {plan.shard_shape[0]} x {plan.shard_shape[1]}",
      f"  bytes/device    {human_bytes(plan.bytes_per_device)}",
      f"  moved/lookup    {human_bytes(plan.bytes_moved_per_lookup)} per device"
      f" for {plan.ids_per_device} ids per device",
      *([f"  across nodes    {human_bytes(plan.node_bytes()[1])} per lookup per device"
         f" ({human_bytes(plan.node_bytes()[0])} inside its node of {plan.devices_per_node};"
         f" {plan.nodes} nodes{', two-level route' if plan.node_route else ''})"]
        if plan.nodes > 1 else []),
      f"  moved/update    {update_summary(plan)}",
      f"  memory/step     {memory_summary(plan)}",
      *([f"  route capacity  {plan.capacity_for(plan.ids_per_device)} ids per "
         f"destination"] if plan.strategy == options.ROUTED else []),
      *([f"  node capacity   {plan.node_capacity_for(plan.capacity_for(plan.ids_per_device))}"
         f" distinct ids per destination from each node"] if plan.node_route else []),
      f"  reason          {plan.reason}",
      *([f"  placement       {line}" for line in plan.placement.describe()]
        if plan.placement is not None else []),
  ]
  return "\n".join(wrapped for line in lines for wrapped in textwrap.wrap(
      line, PRINT_WIDTH, subsequent_indent=" " * VALUE_COLUMN, break_on_hyphens=False))


def update_summary(plan) -> str:
  """The sparse optimizers' bytes a step, for the ``moved/update`` line."""
  way, moved = plan.sparse_update(plan.ids_per_device)
  if way == "none":
    return "0 B per device (one data shard: the sparse optimizers gather no row gradients)"
  words = {"gather": "all-gather", "route": "route to their owners",
           "allreduce": "all-reduce"}
  text = f"{human_bytes(moved)} per device, the sparse optimizers' {words[way]} of row gradients"
  if plan.nodes > 1 and way == "route":
    text += f" ({human_bytes(plan.update_node_bytes(plan.ids_per_device)[1])} across nodes)"
  return text


def memory_summary(plan) -> str:
  """A device's bytes for the table's training step, for the ``memory/step`` line."""
  m = plan.memory()
  slots = plan.optimizer if isinstance(plan.optimizer, str) else "sparse optimizer"
  return (f"{human_bytes(m.total)} per device: table {human_bytes(m.table)}, {slots} slots "
          f"{human_bytes(m.slots)}, ids {human_bytes(m.ids)}, temporaries "
          f"{human_bytes(m.temporary)}")
