"""The rules a table's sizes and a plan's arguments must meet, with errors that name the fix.

Each check returns the value to use (an int, axes in order) or raises a
ValueError / TypeError naming the table, the argument, the rule and the fix.
"""

from __future__ import annotations

import numpy as np

from embedlib import options
from embedlib.plan import mesh_axes

#: Most rows a physical table (or stack) may have: ids are int32 (x64 off),
#: and a row count past int32's largest can't even be compared with them.
MAX_PHYSICAL_ROWS = 2**31 - 1


def check_shape(num_embeddings, features, name: str = "table") -> tuple[int, int]:
  """``(num_embeddings, features)`` as ints, or a ValueError / TypeError naming the table.

  >>> check_shape(10, 4)
  (10, 4)
  """
  return (check_size(num_embeddings, "num_embeddings", name),
          check_size(features, "features", name))


def check_size(value, what: str, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name}: {what} must be an int, got {value!r}.")
  if value < 1:
    raise ValueError(
        f"{name}: {what} must be >= 1, got {value}; an embedding table needs "
        f"at least one row and one column."
    )
  return int(value)


def auto_grid_columns(shape, sharding, table, data, column_axes, name):
  """The column axes of the grid ``auto`` may fall back to, or ``()`` if there is none."""
  if sharding != options.AUTO:
    return ()
  columns = mesh_axes.as_axes(column_axes, "column_axes", name)
  if columns is None:
    columns = tuple(a for a in data if a not in table)
  if not columns or not table or set(columns) & set(table):
    return () if column_axes is None else grid_column_axes(
        shape, options.GRID, table, data, column_axes, name)
  return grid_column_axes(shape, options.GRID, table, data, columns, name)


def grid_column_axes(shape, sharding, table, data, column_axes, name):
  """A grid's column axes, token axes first; ``()`` for the 1-D layouts."""
  if sharding != options.GRID:
    if sharding != options.AUTO and column_axes is not None and tuple(column_axes):
      raise ValueError(
          f"{name}: column_axes={column_axes!r} splits the columns as well as the "
          f"rows, which only sharding='grid' does (got sharding={sharding!r}); pass "
          f"sharding='grid', or drop column_axes."
      )
    return ()
  columns = mesh_axes.as_axes(column_axes, "column_axes", name)
  if columns is None:
    columns = tuple(a for a in data if a not in table)
  mesh_axes.check_axes(columns, "column_axes", shape, name)
  both = [a for a in columns if a in table]
  if both:
    raise ValueError(
        f"{name}: axis {both[0]!r} is in both table_axes={table} (rows) and "
        f"column_axes={columns} (columns); a mesh axis splits one dimension: "
        f"name it on one of them."
    )
  if not columns or not table:
    raise ValueError(
        f"{name}: sharding='grid' splits rows over table_axes and columns over "
        f"column_axes, got table_axes={table} and column_axes={columns} on the mesh "
        f"{dict(shape)}; pass both, e.g. table_axes=('tensor',), column_axes=('fsdp',)."
    )
  return tuple(a for a in columns if a in data) + tuple(a for a in columns if a not in data)


def check_rows(num_embeddings, rows, strategy, group, placement, name):
  """Raises unless every (physical) row of the table is an int32 id."""
  if max(num_embeddings, rows) <= MAX_PHYSICAL_ROWS:
    return
  if placement is not None:
    members = ", ".join(f"{m} ({r:,} rows)" for m, r in placement.members)
    raise ValueError(
        f"{name}: this stack of tables [{members}] has {rows:,} physical rows "
        f"({group} devices x {placement.rows_per_rank:,}), past the {MAX_PHYSICAL_ROWS:,} "
        f"that int32 ids address; give its largest tables another layout "
        f"(sharding='vocab' or 'routed' splits a table's rows over the devices instead of "
        f"holding it whole on one), or split them into smaller tables.")
  padding = f" (padded to {rows:,} for {strategy} over {group})" if rows != num_embeddings else ""
  raise ValueError(
      f"{name}: {num_embeddings:,} rows{padding} is past the {MAX_PHYSICAL_ROWS:,} that "
      f"int32 ids address; split the table into tables of at most {MAX_PHYSICAL_ROWS:,} "
      f"rows, or hash its ids into fewer rows.")


def check_placement(placement, num_embeddings, group, sharding, name):
  if sharding not in (options.AUTO, options.ROUTED):
    raise ValueError(
        f"{name}: a stack of tables (placement=) is routed; pass sharding='routed' "
        f"or 'auto', not {sharding!r}."
    )
  if placement.group != group or placement.num_embeddings != num_embeddings:
    raise ValueError(
        f"{name}: the placement is for {placement.num_embeddings} rows on "
        f"{placement.group} devices, the table has {num_embeddings} rows on a group "
        f"of {group}; plan the placement for this table and mesh."
    )


def check_skew(skew, name: str) -> float:
  """``id_skew``: a Zipf exponent, finite and >= 0."""
  if (isinstance(skew, bool) or not isinstance(skew, (int, float, np.integer, np.floating))
      or not 0 <= skew < float("inf")):
    raise ValueError(
        f"{name}: id_skew must be a finite number >= 0 (0: uniform ids), got {skew!r}; "
        "embedlib.collection.fit_id_skews fits it from a batch of ids.")
  return float(skew)


def check_capacity(capacity, group: int, name: str, what: str = "route_capacity") -> int:
  """A route capacity must hold at least one id per destination."""
  if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
    raise TypeError(
        f"{name}: {what} must be an int (ids per destination rank), got "
        f"{capacity!r}."
    )
  if capacity < 1:
    raise ValueError(
        f"{name}: {what}={capacity} can't hold one id per destination "
        f"(the table group has {group} ranks); pass {what} >= 1, or "
        f"None to size it from the ids per device."
    )
  return int(capacity)


def check_devices_per_node(per, group: int, table, name: str) -> int:
  """Devices per node must split the table group into whole nodes (or hold it whole)."""
  if isinstance(per, bool) or not isinstance(per, (int, np.integer)) or per < 1:
    raise ValueError(
        f"{name}: devices_per_node={per!r} must be a positive int, the devices one node "
        f"holds; pass e.g. devices_per_node=8, or None to read it from the devices."
    )
  per = int(per)
  if group % per and per % group:
    divisors = [d for d in range(1, group + 1) if group % d == 0]
    raise ValueError(
        f"{name}: devices_per_node={per} doesn't divide the table group of {group} "
        f"devices (table_axes {tuple(table)}), so the group's ranks can't be split into "
        f"whole nodes; pass one of {divisors} (the devices of one node that hold this "
        f"table), or None to read it from the devices."
    )
  return per
