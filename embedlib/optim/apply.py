"""Applying row gradients to a sharded table: dedup, then update the owned rows.

The functional core of the sparse optimizers. Given ``(ids, row_grads)``
pairs for one table (one pair per lookup of it in the step), each rank:

1. input distribution: all-gathers the pairs over the data axes, so every
   rank sees the whole batch's ids (the transpose of the lookup's own
   all-gather/psum-scatter, plus the gradient sum over data-parallel
   replicas, which then apply identical updates); where that moves more
   bytes, a row-split table routes each distinct id's summed gradient to
   its owner (``route.py``) and a small whole table all-reduces every
   row's summed gradient (``allreduce.py``);
2. dedup: one summed gradient per distinct id, found one of three ways,
   chosen statically from shapes and the rule's slots:

   - by rows (``dedup_rows``), when the rank's shard has no more rows than
     the step has ids: the gradients are summed straight into their rows
     and the rule runs on every row of the shard, untouched ones gathered
     as zeros and never written back (the small tables of a recommender
     batch);
   - by marks (``dedup_marks``), for larger shards when the rule has a
     slot (AdaGrad, LazyAdam): each id writes its position into its row of
     the slot, and the winner it reads back names its segment; no sort;
   - by sorting (``dedup``) otherwise (SGD, which has no slot): a sort with
     a static size and a binary search;

   all three sum each row's gradients in input order and give bit-for-bit
   the same tables and slots (``tests/optim/test_dense_path.py``,
   ``tests/optim/test_marks_path.py``);
3. local update: for the rows the rank owns (vocab: its block of rows;
   hidden: its column slice of every touched row; grid: its column slice
   of its block's touched rows; replicated: all), it
   gathers their slots, runs the rule and scatter-adds the rule's increment
   into its shard (the rules read slots, not weights, so the table itself is
   never gathered). Distinct ids never collide, and with the table donated
   XLA updates it in place.

Nothing the size of the table is built besides the table and its slots:
every temporary is ``[ids, features]`` or smaller (see
``tests/optim/test_memory.py``), on the dense path too since it only runs
when rows <= ids. Invalid ids (``-1`` after ``invalid_ids.sanitize``) and
padded rows are owned by no rank, so they are never written.

On CPU, steps 2 and 3 are one fused C++ call per shard instead
(``fused_cpu.py``: a hash of the ids in place of the three dedups, the
same sums in the same order, the rule in place on the aliased table and
slots), where its library builds and the rule and dtypes are ones it
implements, and the XLA ops here otherwise. Every other platform runs
``sorted_update.py``: the dedups here sum with scatter-adds whose indices
collide, which XLA:GPU runs as atomic adds; that one sorts, reduces each
run of equal ids with a scan and writes each row once.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import _compat
from embedlib import sharding as sharding_lib
from embedlib import options
from embedlib import invalid_ids as invalid_lib
from embedlib.optim import allreduce
from embedlib.optim import fused_cpu
from embedlib.optim import route as route_lib
from embedlib.optim import rules as rules_lib
from embedlib.optim import sorted_update
from embedlib.strategies import collectives, rowmap


def slot_spec(slot: rules_lib.Slot, plan) -> tuple:
  """Per-dimension mesh axes of a slot: like the table, or like its rows.

  Row slots are split with the rows for vocab sharding, and whole on every
  rank for hidden sharding: each hidden rank holds every row (a slice of its
  columns), so it can update the row's slot without communication. A grid's
  row slots are split with its rows and whole over its column axes, for the
  same reason.

  >>> from embedlib.plan import plan_embedding
  >>> p = plan_embedding(100, 64, mesh={"model": 4}, sharding="vocab")
  >>> slot_spec(rules_lib.Slot("row"), p), slot_spec(rules_lib.Slot("table"), p)
  ((('model',),), (('model',), None))
  >>> g = plan_embedding(99, 10, mesh={"fsdp": 2, "tensor": 4}, sharding="grid")
  >>> slot_spec(rules_lib.Slot("row"), g), slot_spec(rules_lib.Slot("table"), g)
  ((('tensor',),), (('tensor',), ('fsdp',)))
  """
  if slot.kind == rules_lib.TABLE:
    return plan.table_spec
  if plan.strategy in options.ROW_BLOCKS:
    return (plan.table_axes,)
  return (None,)


def slot_shape(slot: rules_lib.Slot, plan) -> tuple[int, ...]:
  """``plan.padded_shape`` for table slots, ``(padded_rows,)`` for row slots."""
  if slot.kind == rules_lib.TABLE:
    return plan.padded_shape
  return plan.padded_shape[:1]


def init_slots(rule: rules_lib.RowRule, plan, mesh) -> dict[str, jax.Array]:
  """The rule's slots for one table, padded and laid out like the table.

  Args:
    rule: a ``RowRule`` (``SparseSGD``, ``RowWiseAdagrad``, ``LazyAdam``).
    plan: the table's ``EmbeddingPlan``.
    mesh: the table's mesh (``Mesh``, ``AbstractMesh``) or None.

  Returns:
    Slot name -> array of ``slot_shape`` with sharding ``slot_spec``.

  >>> from embedlib.plan import plan_embedding
  >>> slots = init_slots(rules_lib.RowWiseAdagrad(), plan_embedding(5, 3), None)
  >>> slots["acc"].shape
  (5,)
  """
  out = {}
  for name, slot in rule.slots().items():
    make = lambda s=slot: jnp.full(slot_shape(s, plan), s.init, s.dtype)
    if mesh is None:
      out[name] = make()
      continue
    sharding = NamedSharding(mesh, P(*slot_spec(slot, plan)))
    if sharding_lib.has_devices(mesh):
      # Built in place on each device: no full-size slot on one device first.
      value = jnp.full(slot_shape(slot, plan), slot.init, slot.dtype, device=sharding)
      # Traced (``nnx.eval_shape``, jit), ``device=`` may leave the value
      # typed replicated (on compile-only devices it does): an abstract
      # build would then hold every slot whole on each device.
      out[name] = (sharding_lib.place_always(value, sharding)
                   if isinstance(value, jax.core.Tracer) else value)
    else:
      out[name] = sharding_lib.place_always(make(), sharding)
  return out


def _flatten(pairs, plan):
  """Flat, sanitised ``(ids [n], grads [n, features])`` per pair with ids (``n > 0``)."""
  out = []
  for ids, grads in pairs:
    ids = invalid_lib.as_ids(ids, plan.num_embeddings)
    grads = jnp.asarray(grads)
    if grads.shape != ids.shape + (plan.features,):
      raise ValueError(
          f"{plan.name}: row gradients of shape {grads.shape} do not match ids "
          f"of shape {ids.shape}; pass one [features={plan.features}] "
          f"gradient row per id, i.e. shape {ids.shape + (plan.features,)}."
      )
    if not ids.size:
      # Touches no row. Dropped here, so a step with only empty lookups
      # returns the table as given and no update path meets zero-size ids.
      continue
    flat = invalid_lib.sanitize(ids.reshape(-1), plan.num_embeddings)
    out.append((flat, grads.reshape(-1, plan.features)))
  return out


def dedup(ids, grads):
  """Sums the gradients of equal ids: one row per distinct id.

  A single-operand sort of the ids and a binary search for each id's first
  position in it: cheaper than ``jnp.unique`` with ``return_inverse`` (a
  two-operand sort), with the same static size.

  Args:
    ids: ``[n]`` int32, ``-1`` for invalid ids.
    grads: ``[n, f]``.

  Returns:
    ``(uids, sums)``: ``[n]`` and ``[n, f]`` float32. Each distinct id
    appears once in ``uids`` with its summed gradient beside it; the other
    entries of ``uids`` are ``-1`` (and so is the entry of invalid ids).

  >>> uids, sums = dedup(jnp.array([3, -1, 3, 0]), jnp.array([[1.0], [5.0], [2.0], [4.0]]))
  >>> uids.tolist(), sums[:, 0].tolist()
  ([-1, 0, 3, -1], [5.0, 4.0, 3.0, 0.0])
  """
  n = ids.shape[0]
  ordered = lax.sort(ids)
  first = jnp.searchsorted(ordered, ids, method="scan_unrolled").astype(jnp.int32)
  is_first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
  uids = jnp.where(is_first & (ordered >= 0), ordered, -1)
  sums = jax.ops.segment_sum(grads.astype(jnp.float32), first, num_segments=n)
  return uids, sums


def _use_dense_update(rows: int, num_ids: int) -> bool:
  """Whether a shard of ``rows`` rows takes the dense path for ``num_ids`` ids.

  Static (shapes only). Bounded by ``num_ids`` so the dense path's
  ``[rows, ...]`` temporaries are never larger than the sort path's
  ``[num_ids, ...]`` ones: a large table keeps the sort path and its
  no-table-sized-temporary guarantee.
  """
  return rows <= num_ids


def dedup_rows(ids, grads, rows):
  """``dedup`` for ids already in ``[0, rows)``, ``rows <= n``: no sort.

  Sums each id's gradient straight into its row: one scatter-add and one
  scatter of a mask, in place of ``dedup``'s sort and binary search (~15
  gathers).

  Args:
    ids: ``[n]`` int32, a row in ``[0, rows)``, or anything else to skip
      the id (it is dropped).
    grads: ``[n, f]``.
    rows: static, at most ``n``.

  Returns:
    ``(idx, sums, sq_mean)``: ``[rows]``, ``[rows, f]`` float32 and
    ``[rows]``. ``idx[r]`` is ``r`` for each row some id hit, ``rows``
    elsewhere; ``sums[r]`` the row's summed gradient (``dedup``'s sums,
    added in the same, input, order) and ``sq_mean[r]`` the mean of its
    squares.

  >>> idx, sums, _ = dedup_rows(jnp.array([3, -1, 3, 0]), jnp.array([[1.0], [5.0], [2.0], [4.0]]), 4)
  >>> idx.tolist(), sums[:, 0].tolist()
  ([0, 4, 4, 3], [4.0, 0.0, 0.0, 3.0])
  """
  n = ids.shape[0]
  # Skipped ids go to n, past the buffers (``rows`` itself may be < n).
  ids = jnp.where((ids >= 0) & (ids < rows), ids, n)
  # Summed into [n, f] like ``dedup``'s sums and cut to the rows after the
  # squares' mean: XLA's CPU reduction rounds differently for different
  # shapes, and the same shape keeps the mean bit-for-bit the sort path's.
  sums = jax.ops.segment_sum(grads.astype(jnp.float32), ids, num_segments=n)
  sq_mean = jnp.sum(sums * sums, axis=1) / grads.shape[1]
  # Touched = hit by at least one valid id, whatever its gradient: LazyAdam
  # decays the moments and counts a step on a touched row even with a zero
  # (or cancelling) gradient, as with ``dedup``.
  touched = jnp.zeros((rows,), bool).at[ids].set(True, mode="drop")
  idx = jnp.where(touched, jnp.arange(rows, dtype=jnp.int32), rows)
  return idx, sums[:rows], sq_mean[:rows]


#: Positions are marked as float32 values, exact below 2**24.
_MAX_MARKED_IDS = 1 << 24


def _scratch_slot(slots, num_ids: int) -> str | None:
  """The slot ``dedup_marks`` may mark: a row slot if there is one, else a table slot."""
  for ndim in (1, 2):
    for name, value in slots.items():
      exact = value.dtype == jnp.int32 or (
          value.dtype == jnp.float32 and num_ids <= _MAX_MARKED_IDS
      )
      if value.ndim == ndim and exact:
        return name
  return None


def dedup_marks(idx, grads, scratch):
  """``dedup`` without a sort, by marking each touched row of a slot.

  Every id writes its position into its row of ``scratch`` (one scatter of
  ``n`` numbers; with repeated ids one write wins, whichever it is), then
  reads the row back: ids of one row all read the same winning position,
  which becomes their segment: one scatter and one gather in place of
  ``dedup``'s sort and binary search. The marked rows
  hold garbage until the caller rewrites them, which it must: each touched
  row is the first row of exactly one segment (its winner's) and gets its
  new slot values there.

  Args:
    idx: ``[n]`` int32, a row of this shard, or ``rows`` (and beyond) to
      skip the id.
    grads: ``[n, f]``.
    scratch: an int32 or float32 (``n <= 2**24``) slot shard, ``[rows]``
      or ``[rows, w]`` (its first column is marked). Read it for its values
      before this call.

  Returns:
    ``(first, sums, marked)``: ``first`` ``[n]`` is ``idx`` at one position
    per touched row and ``rows`` elsewhere; ``sums`` ``[n, f]`` float32 holds
    each row's summed gradient (added in input order, as ``dedup`` does) at
    that position; ``marked`` is ``scratch`` with the touched rows
    overwritten.

  >>> first, sums, _ = dedup_marks(jnp.array([3, 4, 3, 0]),
  ...     jnp.array([[1.0], [5.0], [2.0], [4.0]]), jnp.zeros(4))
  >>> sorted(first.tolist()), sums[:, 0].tolist()
  ([0, 3, 4, 4], [0.0, 0.0, 3.0, 4.0])
  """
  n, rows = idx.shape[0], scratch.shape[0]
  at = (idx,) if scratch.ndim == 1 else (idx, 0)
  positions = jnp.arange(n, dtype=jnp.int32)
  marked = scratch.at[at].set(positions.astype(scratch.dtype), mode="drop")
  winner = marked.at[at].get(mode="fill", fill_value=-1).astype(jnp.int32)
  owned = idx < rows
  first = jnp.where(owned & (winner == positions), idx, rows)
  segments = jnp.where(owned, winner, n)
  sums = jax.ops.segment_sum(grads.astype(jnp.float32), segments, num_segments=n)
  return first, sums, marked


def _local_update(rule, table, slots, ids, grads, lr, step, *, plan):
  """Dedup and update on one rank: every array here is this rank's shard.

  On CPU, where ``fused_cpu`` supports the rule, one fused C++ call, else
  the XLA ops of ``_xla_local_update``; on every other platform the sorted
  update of ``sorted_update`` (no scatter-add with colliding indices, which
  XLA:GPU runs as atomics). The choice is staged with
  ``lax.platform_dependent``, so the platform the step is lowered for picks
  it, whatever machine traced the step.

  Args:
    table: ``plan.shard_shape``.
    slots: slot name -> this rank's slot shard.
    ids: ``[n]`` int32, the whole batch's ids, ``-1`` invalid.
    grads: ``[n, features]``, their row gradients.
  """
  origin = _shard_origin(table, plan)
  xla = lambda: _xla_local_update(rule, table, slots, ids, grads, lr, step, plan=plan)
  by_sorting = lambda: sorted_update.local_update(
      rule, table, slots, ids, grads, lr, step, plan=plan, origin=origin)
  forced = sorted_update.forced()   # None outside tests and benchmarks
  cpu, gpu = xla, (xla if forced is False else by_sorting)
  if forced:
    cpu = by_sorting
  elif fused_cpu.supports(rule, table, slots):
    cpu = lambda: fused_cpu.update(
        rule, table, slots, ids, grads, lr, step,
        first_row=origin[0], first_col=origin[1], features=plan.features,
    )
  return lax.platform_dependent(cpu=cpu, default=gpu)


def _shard_origin(table, plan):
  """This rank's first global row (vocab, grid) and first logical column (hidden, grid); 0 otherwise."""
  rows_here, cols_here = table.shape
  first_row = first_col = 0
  if plan.strategy in options.ROW_BLOCKS:
    first_row = collectives.group_rank(plan.table_axes) * rows_here
  if plan.strategy in options.COLUMN_SPLIT:
    # A hidden table splits its columns over the table axes, a grid over its column axes.
    columns = plan.column_axes if plan.strategy == options.GRID else plan.table_axes
    first_col = collectives.group_rank(columns) * cols_here
  return first_row, first_col


def _xla_local_update(rule, table, slots, ids, grads, lr, step, *, plan):
  """``_local_update`` in XLA ops: the CPU's path where the fused update does not apply."""
  rows_here, cols_here = table.shape
  offset, first_col = _shard_origin(table, plan)
  local = jnp.where(ids >= 0, ids - offset, -1)
  scratch = _scratch_slot(slots, ids.shape[0])
  read_slots = lambda idx: {
      k: v.at[idx].get(mode="fill", fill_value=0) for k, v in slots.items()
  }
  row_sq_mean = None
  if _use_dense_update(rows_here, ids.shape[0]):
    # Small shard: dedup by row, no sort. The rest is shared with the other
    # paths (same shapes, same ops) so they give bit-for-bit the same
    # tables and slots: with ``where(touched, ...)`` over the whole shard
    # instead, XLA's CPU fusion contracts ``a * b + c`` into fused
    # multiply-adds in other places, and reduces of other shapes round
    # differently, an ulp or two off.
    idx, g, row_sq_mean = dedup_rows(local, grads, rows_here)
    old = read_slots(idx)
  elif scratch is not None:
    idx = jnp.where((local >= 0) & (local < rows_here), local, rows_here)
    # Read every slot before marking: the mark overwrites the scratch slot
    # in place (no copy of it), and ``old`` then has each touched row's
    # values at its first position.
    old = read_slots(idx)
    # ``idx`` made to depend on the reads (max with 0 or -1: unchanged), so
    # that XLA orders them before the marks; without a data dependency it
    # copies the slot to keep the reads' input alive (control dependencies,
    # such as an optimization_barrier's, do not stop that copy).
    read = old[scratch].reshape(idx.shape[0], -1)[:, 0]
    flag = read == jnp.iinfo(jnp.int32).min if read.dtype == jnp.int32 else read != read
    idx = jnp.maximum(idx, -flag.astype(idx.dtype))
    idx, g, marked = dedup_marks(idx, grads, slots[scratch])
    slots = dict(slots, **{scratch: marked})
  else:
    uids, g = dedup(ids, grads)
    local = uids - offset
    owned = (uids >= 0) & (local >= 0) & (local < rows_here)
    # Rows this rank does not own point past the end: gathered as zeros and
    # dropped by the scatters.
    idx = jnp.where(owned, local, rows_here)
    old = read_slots(idx)
  if row_sq_mean is None:
    # Over the logical columns, before any column slicing: row-wise rules
    # normalise by the whole row on every rank.
    row_sq_mean = jnp.sum(g * g, axis=1) / plan.features
  if plan.strategy in options.COLUMN_SPLIT:
    g = jnp.pad(g, ((0, 0), (0, plan.padded_shape[1] - plan.features)))
    g = lax.dynamic_slice_in_dim(g, first_col, cols_here, axis=1)
  # Owned indices are distinct, so adding the increment is the same as
  # setting the new row, without reading the table. Untouched rows are
  # never written: exact whatever the rule computes for them.
  delta, new_slots = rule.update(old, g, row_sq_mean=row_sq_mean, lr=lr, step=step)
  table = table.at[idx].add(delta.astype(table.dtype), mode="drop")
  out = {}
  for name, value in slots.items():
    # Every slot is written at every touched row (a rule that keeps a slot
    # unchanged gets its old values back): the marked scratch rows need it.
    new = new_slots.get(name, old[name])
    out[name] = value.at[idx].set(new.astype(value.dtype), mode="drop")
  return table, out


def apply_row_grads(
    rule: rules_lib.RowRule,
    table: jax.Array,
    slots: dict[str, jax.Array],
    pairs: Sequence[tuple[jax.Array, jax.Array]],
    *,
    plan,
    mesh,
    step,
):
  """One sparse update of a physical table from ``(ids, row_grads)`` pairs.

  Args:
    rule: a ``RowRule``.
    table: the physical (padded, sharded) table, ``plan.padded_shape``.
    slots: the rule's slots, from ``init_slots``.
    pairs: ``(ids, row_grads)`` per lookup of the table: ids of any shape
      (invalid ids are skipped), ``row_grads`` of shape
      ``ids.shape + (features,)``. Ids repeated within or across pairs get
      one update with their gradients summed. For a pooled bag, pass each
      id with ``coefficient * bag_gradient``.
    plan: the table's ``EmbeddingPlan``.
    mesh: the table's mesh, or None.
    step: int scalar, updates applied before this one (for schedules).

  Returns:
    ``(table, slots)``, laid out as given. Jit with both donated to update
    them in place.

  >>> import jax.numpy as jnp
  >>> from embedlib.plan import plan_embedding
  >>> plan, rule = plan_embedding(4, 2), rules_lib.SparseSGD(1.0)
  >>> table, _ = apply_row_grads(rule, jnp.zeros((4, 2)), {},
  ...     [(jnp.array([1, 1, -1]), jnp.ones((3, 2)))], plan=plan, mesh=None, step=0)
  >>> table.tolist()
  [[0.0, 0.0], [-2.0, -2.0], [0.0, 0.0], [0.0, 0.0]]
  """
  pairs = _flatten(pairs, plan)
  if not pairs:
    return table, slots
  step = jnp.asarray(step, jnp.int32)
  lr = rule.lr(step)
  specs = {k: P(*slot_spec(s, plan)) for k, s in rule.slots().items()}
  if set(specs) != set(slots):
    raise ValueError(
        f"{plan.name}: slots {sorted(slots)} do not match the rule's "
        f"{sorted(specs)}; build them with init_slots(rule, plan, mesh)."
    )
  if mesh is None:
    ids = jnp.concatenate([rowmap.physical_ids(i, plan) for i, _ in pairs])
    grads = jnp.concatenate([g for _, g in pairs])
    return _local_update(rule, table, slots, ids, grads, lr, step, plan=plan)

  data = plan.data_axes or None
  ids_spec, grads_spec = P(data), P(data, None)
  table_spec = P(*plan.table_spec)
  ids_in = [
      sharding_lib.place(sharding_lib.pad_tokens(i, plan.data_shards, -1), mesh, ids_spec)
      for i, _ in pairs
  ]
  grads_in = [
      sharding_lib.place(sharding_lib.pad_tokens(g, plan.data_shards, 0), mesh, grads_spec)
      for _, g in pairs
  ]
  table = sharding_lib.place(table, mesh, table_spec)
  slots = {k: sharding_lib.place(v, mesh, specs[k]) for k, v in slots.items()}
  lr = sharding_lib.place(lr, mesh, P())
  step = sharding_lib.place(step, mesh, P())

  # Input distribution: all-gather every rank's pairs over the data axes;
  # or, where that moves fewer bytes, route each distinct id's summed
  # gradient to its owner (``route.py``, row-split tables), or all-reduce
  # every row's summed gradient (``allreduce.py``, small whole tables).
  local_ids = sum(i.shape[0] for i in ids_in) // plan.data_shards
  capacity = plan.update_capacity(local_ids)
  itemsize = grads_in[0].dtype.itemsize
  routes = route_lib.pays(plan, local_ids, itemsize)
  reduces = allreduce.pays(plan, local_ids, itemsize)

  def body(table, slots, ids, grads, lr, step):
    update = lambda i, g: _local_update(rule, table, slots, i, g, lr, step, plan=plan)
    # A stack's ids are its logical rows; updates go to the physical ones.
    ids = [rowmap.physical_ids(i, plan) for i in ids]

    def gathered():
      i, g = ids, grads
      if plan.data_axes:
        # "invarying": every rank then holds the same ids and gradients, so
        # data-parallel replicas of a shard compute the same new rows.
        gather = lambda x: lax.all_gather(
            x, plan.data_axes, axis=0, tiled=True, to="invarying"
        )
        i, g = map(gather, i), map(gather, g)
      return jnp.concatenate(list(i)), jnp.concatenate(list(g))

    if reduces:
      return update(*allreduce.summed(jnp.concatenate(ids), jnp.concatenate(grads),
                                      rows=table.shape[0], axes=plan.data_axes))
    if not routes:
      return update(*gathered())
    return route_lib.routed_update(
        jnp.concatenate(list(ids)), jnp.concatenate(list(grads)), table, slots, plan=plan,
        rows_per_rank=table.shape[0], capacity=capacity,
        update=lambda t, s, i, g: _local_update(rule, t, s, i, g, lr, step, plan=plan))

  return _compat.shard_map(
      body,
      mesh=mesh,
      in_specs=(table_spec, specs, [ids_spec] * len(pairs),
                [grads_spec] * len(pairs), P(), P()),
      out_specs=(table_spec, specs),
  )(table, slots, ids_in, grads_in, lr, step)
