"""Fused sparse update with many rows in flight (Triton): each run reduced and its row updated once.

``segment_rows`` sums each run of equal ids (sorted, cut into pieces so that
a hot id is summed by many programs) in registers; here the program that
finishes a run applies the row-wise rule to its table row and moments: it
reads the run's table row (and Adam's ``m`` and ``v`` rows) once, and
writes them once, in place (table and table slots are aliased to the
outputs). Each run owns its row, so no two writes collide: no atomics, the
same bits on every run. Against ``sorted_update``'s XLA ops, which sum a run
with a scan and run the rule over every sorted position, the gradient rows
are read once and nothing ``[ids, features]`` is written.

The interface is `mosaic_update.fused_update`'s, so ``optim/fused_gpu.py``
runs either: per-row values XLA gathers for the runs before the kernel
(AdaGrad's old accumulator; Adam's bias corrections ``1 - b ** t`` by the
rule's own expressions) come in ``per_run``, and AdaGrad's new accumulators
go out per run, for XLA to write at distinct rows.

Equivalent JAX code: `mosaic_update`'s module docstring (the same rules on
the same runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedlib.kernels import mosaic_update
from embedlib.kernels import rows as rows_lib
from embedlib.kernels.rows import SegmentVariant
from embedlib.kernels.segment_rows import Finish, reduce_runs

SGD, ADAGRAD, ADAM = mosaic_update.SGD, mosaic_update.ADAGRAD, mosaic_update.ADAM
TABLE_SLOTS = mosaic_update.TABLE_SLOTS
#: Per-run values each rule takes (`mosaic_update.fused_update`'s ``per_run``).
PER_RUN = {SGD: 0, ADAGRAD: 1, ADAM: 2}


def supports(table_shape, dtype, *, rule: str = SGD, sq_width: int = 0) -> bool:
  """Whether the kernel updates a ``[rows, width]`` table of ``dtype`` by ``rule``.

  float32 tables and rules of `TABLE_SLOTS`; a column slice's AdaGrad
  (``sq_width``: the whole rows' sum of squares) keeps the XLA ops.

  >>> supports((10, 3), jnp.float32), supports((10, 3), jnp.bfloat16)
  (True, False)
  >>> supports((10, 3), jnp.float32, rule=ADAGRAD, sq_width=6)
  False
  """
  rows, width = table_shape
  return (rule in TABLE_SLOTS and jnp.dtype(dtype) == jnp.float32 and width > 0
          and rows < 2**31 and not (rule == ADAGRAD and sq_width))


class Rule(Finish):
  """Applies ``rule`` to each run's table row (and slots) in place: `Finish` of `fused_update`."""

  def __init__(self, rule, table, table_slots, rows, per_run, lr, *, eps, b1, b2, features):
    self.rule, self.eps, self.b1, self.b2, self.features = rule, eps, b1, b2, features
    self.num_rows = table.shape[0]
    self.chunks = rows_lib.column_chunks(table.shape[1])
    self.inputs = (rows, jnp.asarray(lr, jnp.float32).reshape(1), *per_run)
    new_acc = (jnp.zeros(rows.shape, jnp.float32),) if rule == ADAGRAD else ()
    self.outputs = (table, *table_slots, *new_acc)

  def apply(self, input_refs, output_refs, runs, sums, mask):
    rows_ref, lr_ref, *per_run = input_refs
    row = rows_lib.load_vector(rows_ref, runs, mask, self.num_rows)
    mask = mask & (row < self.num_rows)
    lr = lr_ref[0]
    cols = [rows_lib.iota(w, c0) for c0, w in self.chunks]
    table_ref = output_refs[0]
    if self.rule == ADAM:
      m_ref, v_ref = output_refs[1:3]
      c1 = rows_lib.load_vector(per_run[0], runs, mask, 1.0)[:, None]
      c2 = rows_lib.load_vector(per_run[1], runs, mask, 1.0)[:, None]
      b1, b2 = self.b1, self.b2
      for c, g in zip(cols, sums):
        m = b1 * rows_lib.load(m_ref, row, c, mask) + (1 - b1) * g
        v = b2 * rows_lib.load(v_ref, row, c, mask) + (1 - b2) * g * g
        t = rows_lib.load(table_ref, row, c, mask)
        rows_lib.store(m_ref, row, c, m, mask)
        rows_lib.store(v_ref, row, c, v, mask)
        rows_lib.store(table_ref, row, c, t + -lr * (m / c1) / (jnp.sqrt(v / c2) + self.eps),
                       mask)
      return
    if self.rule == ADAGRAD:
      sq = sum(jnp.sum(g * g, axis=1) for g in sums)
      acc = rows_lib.load_vector(per_run[0], runs, mask, 0.0) + sq / self.features
      scale = (-(lr / (jnp.sqrt(acc) + self.eps)))[:, None]
      rows_lib.store_vector(output_refs[1], runs, acc, mask)
    else:
      scale = -lr
    for c, g in zip(cols, sums):
      t = rows_lib.load(table_ref, row, c, mask)
      rows_lib.store(table_ref, row, c, t + scale * g, mask)


def fused_update(table, grads, src, starts, ends, rows, lr, *, rule: str, table_slots=(),
                 per_run=(), sq_grads=None, eps: float = 0.0, b1: float = 0.0, b2: float = 0.0,
                 features: int, variant: SegmentVariant = SegmentVariant(),
                 interpret: bool = False):
  """Reduces each run's gradient rows and applies ``rule`` to its table row, in place.

  Same arguments and results as `mosaic_update.fused_update` (``sq_grads``
  must be None: `supports`), plus ``variant`` (`SegmentVariant`); the table
  is any `supports` width.

  Returns:
    ``(table, table_slots, new_acc)``.

  >>> table = jnp.zeros((3, 2))
  >>> grads = jnp.array([[1.0, 2.0], [3.0, 4.0]])
  >>> out, _, _ = fused_update(table, grads, jnp.array([0, 1]), jnp.array([0, 2]),
  ...                          jnp.array([2, 2]), jnp.array([1, 3]), 0.5, rule="sgd",
  ...                          features=2, interpret=True)
  >>> out.tolist()
  [[0.0, 0.0], [-2.0, -3.0], [0.0, 0.0]]
  """
  if rule not in TABLE_SLOTS:
    raise ValueError(f"fused_update: rule={rule!r}; use one of {sorted(TABLE_SLOTS)} "
                     "(other rules take sorted_update's XLA ops).")
  if len(per_run) != PER_RUN[rule] or len(table_slots) != len(TABLE_SLOTS[rule]):
    raise ValueError(f"fused_update: rule {rule!r} takes {PER_RUN[rule]} per-run values and "
                     f"table slots {TABLE_SLOTS[rule]}; got {len(per_run)} and "
                     f"{len(table_slots)}.")
  if sq_grads is not None:
    raise ValueError("fused_update (Triton rows): a column slice's AdaGrad (sq_grads) is not "
                     "taken; check supports(..., sq_width=...) and run the XLA ops.")
  finish = Rule(rule, table, table_slots, rows.astype(jnp.int32),
                [x.astype(jnp.float32) for x in per_run], lr, eps=eps, b1=b1, b2=b2,
                features=features)
  if src.shape[0] == 0:
    outs = finish.outputs
  else:
    outs = reduce_runs(grads, src.astype(jnp.int32), starts.astype(jnp.int32),
                       ends.astype(jnp.int32), finish, variant=variant, interpret=interpret)
  new_acc = outs[-1] if rule == ADAGRAD else None
  slots = tuple(outs[1:1 + len(table_slots)])
  return outs[0], slots, new_acc
