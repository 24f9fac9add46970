"""Sparse row-wise optimizers: train embedding tables by the rows a batch touched.

A dense gradient step on an embedding table scatters the batch's row
gradients into a zero array the size of the table and then updates every
row. Here the tables are trained from row gradients instead:

1. ``value_and_grad(loss_fn)(model, ...)`` differentiates a plain NNX model
   with respect to its dense parameters and to the rows each ``ShardedEmbed``
   looked up (never the table), giving ``Grads(dense, rows)``;
2. ``SparseAwareOptimizer(model, tx, rule).update(model, grads)`` applies
   optax to the dense parameters and the row-wise ``rule`` to the tables:
   gradients are deduplicated per id (summed), and each rank updates the
   touched rows it owns inside ``shard_map``.

Rules (``rules.py``): ``SparseSGD``, ``RowWiseAdagrad`` (one accumulator per
row, FBGEMM / TorchRec semantics) and ``LazyAdam`` (moments of touched rows
only). ``apply_row_grads`` and ``init_slots`` are the functional core, for
custom training loops. Untouched rows, padded rows and invalid ids are never
updated; learning rates may be optax schedules.
"""

from embedlib.optim.apply import apply_row_grads, init_slots, slot_shape, slot_spec
from embedlib.optim.optimizer import SparseAwareOptimizer, SparseSlot
from embedlib.optim.row_grads import Grads, NotTables, sparse_tables, table_key, value_and_grad
from embedlib.optim.rules import LazyAdam, RowRule, RowWiseAdagrad, Slot, SparseSGD

__all__ = [
    "Grads",
    "LazyAdam",
    "NotTables",
    "RowRule",
    "RowWiseAdagrad",
    "Slot",
    "SparseAwareOptimizer",
    "SparseSGD",
    "SparseSlot",
    "apply_row_grads",
    "init_slots",
    "slot_shape",
    "slot_spec",
    "sparse_tables",
    "table_key",
    "value_and_grad",
]
