"""``value_and_grad`` that returns row gradients for tables, dense ones for the rest.

The gradient of a lookup with respect to its table is a scatter-add into a
zero array the size of the table. Here the tables are held constant instead,
and each lookup's output gets a zero ``delta`` added to it: the gradient with
respect to ``delta`` is the gradient with respect to the looked-up rows,
``[ids, features]``, and the lookup's ids say which rows they belong to.
Model code stays plain NNX; ``ShardedEmbed`` reports its lookups to the
tape this module opens while the loss runs (``embedlib.tape``: a context
variable scoped to the loss, not a global).

The deltas' shapes are found by tracing the loss once abstractly
(``jax.eval_shape``, no computation), so the loss is traced twice when the
step is compiled. It must make the same lookups, in the same order, both
times (plain Python control flow does). A lookup of a sparse table traced
inside a transformation nested in the loss (a ``jax.jit`` or ``nnx.jit``
of part of the model, a ``vmap``, a ``scan``) raises an error saying what to
change: its ids would be values of the inner trace, which can't leave it.
While the tape is open each sparse table carries a marker in its static
attributes, so a nested ``nnx.jit`` can't reuse a trace made without the
tape (which would skip the lookup's report silently).

Lookups of pooled bags (the collection) report ``coefficients``: the row
gradient of id ``j`` in bag ``b`` is ``coefficients[b, j] * bag_grad[b]``.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct
from jax.sharding import NamedSharding

from embedlib import sharding as sharding_lib
from embedlib import embed as embed_lib
from embedlib import tape as tape_lib
from embedlib.table_paths import table_key


@struct.dataclass
class Grads:
  """Gradients of a model with sparse tables.

  Attributes:
    dense: ``nnx.State`` of the gradients of every ``wrt`` variable that is
      not a sparse table (what ``nnx.grad`` would give for them).
    rows: table key (its module path joined by ``/``) -> tuple of
      ``(ids, row_grads)`` pairs, one per lookup of the table: ids as looked
      up (int32, ``-1`` for invalid), ``row_grads`` of shape
      ``ids.shape + (features,)``. Ids may repeat; the optimizer sums them.
  """

  dense: tp.Any
  rows: dict[str, tuple[tuple[jax.Array, jax.Array], ...]]


def sparse_tables(model, tables=None) -> list[tuple[str, embed_lib.ShardedEmbed]]:
  """The ``ShardedEmbed`` modules of ``model`` that are trained sparsely.

  Args:
    model: an ``nnx.Module``.
    tables: None for every ``ShardedEmbed``, or a predicate
      ``tables(key, module) -> bool``.

  Returns:
    ``(key, module)`` pairs in graph order.

  >>> from flax import nnx
  >>> import embedlib
  >>> emb = embedlib.ShardedEmbed(4, 2, rngs=nnx.Rngs(0))
  >>> [k for k, _ in sparse_tables(nnx.List([emb]))]
  ['0']
  """
  out = []
  for path, module in nnx.iter_graph(model):
    if isinstance(module, embed_lib.ShardedEmbed):
      key = table_key(path)
      if tables is None or tables(key, module):
        out.append((key, module))
  return out


@dataclasses.dataclass(frozen=True)
class NotTables:
  """An nnx filter: every variable except the parameters of the named tables.

  Hashable, so an ``nnx.Optimizer`` holding it stays a static graph node.
  """

  keys: frozenset

  def __call__(self, path, value) -> bool:
    del value
    return not (path and path[-1] == "embedding" and table_key(path[:-1]) in self.keys)


class _Tape:
  """Collects the lookups of sparse tables while the loss runs (``embedlib.tape.Tape``)."""

  def __init__(self, model, tables, deltas):
    self.modules = {id(m): (k, m) for k, m in sparse_tables(model, tables)}
    self.keys = {i: k for i, (k, _) in self.modules.items()}
    self.deltas = deltas  # None on the abstract (shape) pass
    self.calls = []
    self.trace = None

  def __enter__(self):
    self.trace = tape_lib.current_trace()
    for key, module in self.modules.values():
      module.recorded_by_tape = key  # static: part of nested nnx.jit cache keys
    self._scope = tape_lib.recording(self)
    self._scope.__enter__()
    return self

  def __exit__(self, *exc):
    self._scope.__exit__(*exc)
    for _, module in self.modules.values():
      del module.recorded_by_tape

  def _check_trace(self, key):
    if tape_lib.current_trace() != self.trace:
      raise ValueError(
          f"table {key!r} was looked up inside a transformation (jax.jit, "
          "nnx.jit, vmap, scan...) nested in the loss given to "
          "embedlib.optim.value_and_grad, whose lookups can't be recorded for "
          "row gradients. Make the lookup in the loss itself (jit the whole "
          "train step instead of part of the model), or train the table "
          f"densely: tables=lambda key, m: key != {key!r}."
      )

  def lookup(self, module, ids, rows, coefficients=None):
    """Called by every lookup: records it and perturbs the rows by a delta.

    Args:
      module: the ``ShardedEmbed`` looked up.
      ids: int32 ids, ``-1`` for invalid ones.
      rows: the lookup's output, ``ids.shape + (features,)``; for a pooled
        bag, ``ids.shape[:-1] + (features,)``.
      coefficients: None, or for a pooled bag the weight of each id in its
        bag (shape of ``ids``).

    Returns:
      ``rows`` plus the delta for this call (``rows`` itself on the shape
      pass, or for a table trained densely).
    """
    key = self.keys.get(id(module))
    if key is None:
      copied_from = getattr(module, "recorded_by_tape", None)
      if copied_from is not None:
        # A copy of a sparse table made by a nested nnx transformation.
        self._check_trace(copied_from)
      return rows
    self._check_trace(key)
    k = len(self.calls)
    if self.deltas is None:
      sharding = None
      mesh = module.mesh
      if mesh is not None and sharding_lib.is_explicit(mesh, mesh.axis_names):
        sharding = jax.typeof(rows).sharding.spec
      self.calls.append((key, rows.shape, rows.dtype, mesh, sharding))
      return rows
    if k >= len(self.deltas) or self.deltas[k].shape != rows.shape:
      raise RuntimeError(
          f"table {key!r}: lookup #{k} differs between the two traces of the "
          "loss; make the same lookups in the same order on every call (no "
          "data-dependent Python control flow around lookups)."
      )
    coefficients = None if coefficients is None else jax.lax.stop_gradient(coefficients)
    self.calls.append((key, ids, coefficients))
    return rows + self.deltas[k]

  def attend(self, module):
    key = self.keys.get(id(module))
    if key is None:
      key = getattr(module, "recorded_by_tape", None)
    if key is not None:
      raise ValueError(
          f"table {key!r}: attend() uses the whole table, whose gradient is "
          "dense, so it cannot be trained row-sparsely. Train it densely: "
          f"pass tables=lambda key, m: key != {key!r} to value_and_grad and "
          "SparseAwareOptimizer."
      )


def _zeros(shape, dtype, mesh, spec):
  z = jnp.zeros(shape, dtype)
  if spec is None:
    return z
  return sharding_lib.place_always(z, NamedSharding(mesh, spec))


def _row_grads(cot, ids, coefficients):
  if coefficients is None:
    return cot
  return coefficients[..., None].astype(cot.dtype) * cot[..., None, :]


def value_and_grad(fn, *, has_aux: bool = False, wrt=nnx.Param, tables=None):
  """Like ``nnx.value_and_grad``, with row gradients for the sparse tables.

  Differentiates ``fn(model, *args, **kwargs)`` with respect to the ``wrt``
  variables of ``model`` (dense gradients) and to the rows each sparse
  ``ShardedEmbed`` looked up (row gradients); the tables themselves get no
  gradient, so no table-sized array is built. State the loss changes (batch
  statistics, RNG counts) is written back to ``model`` as ``nnx.grad`` does.
  Use it under ``nnx.jit`` (on an Explicit mesh, eager use needs
  ``jax.set_mesh``).

  >>> import jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> import embedlib
  >>> from embedlib import optim
  >>> class Model(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.emb = embedlib.ShardedEmbed(10, 4, rngs=rngs)
  ...     self.out = nnx.Linear(4, 1, rngs=rngs)
  ...   def __call__(self, ids):
  ...     return self.out(self.emb(ids).sum(1))
  >>> model = Model(nnx.Rngs(0))
  >>> loss_fn = lambda m, ids: jnp.mean(m(ids) ** 2)
  >>> loss, grads = optim.value_and_grad(loss_fn)(model, jnp.array([[1, 2], [2, -1]]))
  >>> sorted(grads.rows), sorted(grads.dense.out)
  (['emb'], ['bias', 'kernel'])
  >>> ids, row_grads = grads.rows["emb"][0]
  >>> ids.tolist(), row_grads.shape
  ([[1, 2], [2, -1]], (2, 2, 4))

  Args:
    fn: ``fn(model, *args, **kwargs) -> loss`` or ``(loss, aux)``.
    has_aux: whether ``fn`` returns ``(loss, aux)``.
    wrt: nnx filter of the variables with dense gradients.
    tables: which ``ShardedEmbed`` modules are sparse (see
      ``sparse_tables``); the others are ordinary ``wrt`` parameters.

  Returns:
    A function ``(model, *args, **kwargs) -> (value, Grads)`` where
    ``value`` is ``loss`` or ``(loss, aux)``.
  """

  def wrapped(model, *args, **kwargs):
    keys = frozenset(k for k, _ in sparse_tables(model, tables))
    dense = nnx.All(wrt, NotTables(keys))
    graphdef, state = nnx.split(model)
    shapes = []

    def abstract_run(state):
      merged = nnx.merge(graphdef, state)
      with _Tape(merged, tables, None) as tape:
        out = fn(merged, *args, **kwargs)
      shapes.extend(tape.calls)
      return out

    # Shapes (and shardings) of every sparse lookup, without computing it.
    jax.eval_shape(abstract_run, state)
    keys_order = [c[0] for c in shapes]
    deltas = [_zeros(shape, dtype, mesh, spec) for _, shape, dtype, mesh, spec in shapes]

    def loss(model, deltas):
      with _Tape(model, tables, deltas) as tape:
        out = fn(model, *args, **kwargs)
      if len(tape.calls) != len(deltas):
        raise RuntimeError(
            f"the loss made {len(tape.calls)} sparse-table lookups, but "
            f"{len(deltas)} when traced for shapes; make the same lookups on "
            "every call."
        )
      value, aux = out if has_aux else (out, None)
      recorded = [(ids, coef) for _, ids, coef in tape.calls]
      return value, (aux, recorded)

    grad_fn = nnx.value_and_grad(
        loss, argnums=(nnx.DiffState(0, dense), 1), has_aux=True
    )
    (value, (aux, recorded)), (dense_grads, delta_grads) = grad_fn(model, deltas)
    rows: dict[str, list] = {}
    for key, (ids, coef), cot in zip(keys_order, recorded, delta_grads):
      rows.setdefault(key, []).append((ids, _row_grads(cot, ids, coef)))
    grads = Grads(dense=dense_grads, rows={k: tuple(v) for k, v in rows.items()})
    return ((value, aux) if has_aux else value), grads

  return wrapped
