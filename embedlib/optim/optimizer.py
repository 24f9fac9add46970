"""``SparseAwareOptimizer``: optax for dense parameters, row-wise rules for tables.

One object updates a whole model from the ``Grads`` of
``embedlib.optim.value_and_grad``: the dense gradients go through an ordinary
``nnx.Optimizer`` (any optax transformation), the row gradients of each
sparse ``ShardedEmbed`` through a row-wise rule (``SparseSGD``,
``RowWiseAdagrad``, ``LazyAdam``) that touches only the rows the batch
looked up. The rule's slots live here, one set per table, padded and
sharded exactly like that table (see ``apply.slot_spec``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from embedlib import _compat
from embedlib import embed as embed_lib
from embedlib import param as param_lib
from embedlib.optim import apply as apply_lib
from embedlib.optim import row_grads as row_grads_lib
from embedlib.optim import rules as rules_lib


class SparseSlot(nnx.OptState):
  """A sparse optimizer slot: laid out like its table (``out_sharding``)."""


def no_tables(key, module) -> bool:
  """The ``tables=`` selection of no table: every table trains densely."""
  del key, module
  return False


class SparseAwareOptimizer(nnx.Pytree):
  """Updates dense parameters with optax and sparse tables row by row.

  >>> import jax, jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> import embedlib
  >>> from embedlib import optim
  >>> class Model(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.emb = embedlib.ShardedEmbed(1000, 8, rngs=rngs)
  ...     self.out = nnx.Linear(8, 1, rngs=rngs)
  ...   def __call__(self, ids):
  ...     return self.out(self.emb(ids).sum(1))[:, 0]
  >>> model = Model(nnx.Rngs(0))
  >>> opt = optim.SparseAwareOptimizer(
  ...     model, optax.adam(1e-3), optim.RowWiseAdagrad(learning_rate=0.1))
  >>> @nnx.jit(donate_argnums=(0, 1))
  ... def train_step(model, opt, ids, y):
  ...   loss_fn = lambda m: jnp.mean((m(ids) - y) ** 2)
  ...   loss, grads = optim.value_and_grad(loss_fn)(model)
  ...   opt.update(model, grads)
  ...   return loss
  >>> ids, y = jnp.array([[1, 2], [2, -1]]), jnp.array([1.0, -1.0])
  >>> before = jnp.copy(model.emb.embedding[...])   # the step donates the table
  >>> losses = [float(train_step(model, opt, ids, y)) for _ in range(3)]
  >>> losses[2] < losses[0]
  True
  >>> changed = jnp.any(model.emb.embedding[...] != before, axis=1)
  >>> jnp.flatnonzero(changed).tolist()        # only the rows looked up
  [1, 2]
  >>> int(opt.step[...]), opt.slots[0]["acc"].shape
  (3, (1000,))

  Args:
    model: the ``nnx.Module`` to train.
    tx: optax transformation for the dense parameters, or None when the
      model has none.
    sparse: the row-wise rule for every sparse table, or None to train
      every table densely with ``tx`` (a table tied to an output layer,
      whose gradient is dense anyway); ``tables`` is then ``no_tables``:
      pass ``tables=optimizer.tables`` to ``value_and_grad``.
    wrt: nnx filter of the trainable variables (tables included or not:
      sparse tables are always taken out of the dense set).
    tables: which ``ShardedEmbed`` modules are sparse: None for all, or a
      predicate ``tables(key, module) -> bool`` (see ``value_and_grad``;
      pass the same one to both).
  """

  def __init__(
      self,
      model: nnx.Module,
      tx,
      sparse: rules_lib.RowRule,
      *,
      wrt=nnx.Param,
      tables=None,
  ):
    if sparse is None:
      if tables is not None:
        raise ValueError(
            "SparseAwareOptimizer: sparse=None trains every table densely; drop tables=, "
            "or pass a row-wise rule for the tables it selects."
        )
      tables = no_tables
    elif not isinstance(sparse, rules_lib.RowRule):
      raise TypeError(
          f"SparseAwareOptimizer: sparse={sparse!r} is not a row-wise rule; "
          "pass SparseSGD(...), RowWiseAdagrad(...) or LazyAdam(...) (optax "
          "transformations go in tx, for the dense parameters)."
      )
    found = row_grads_lib.sparse_tables(model, tables)
    if not found and sparse is not None:
      raise ValueError(
          "SparseAwareOptimizer: the model has no ShardedEmbed "
          + ("that tables= selects" if tables is not None else "table")
          + " to train row-wise; build its tables with embedlib.ShardedEmbed "
          "(a drop-in for nnx.Embed), or use nnx.Optimizer for a model without them."
      )
    self.keys = tuple(k for k, _ in found)
    self.tables = tables
    self.rule = sparse
    dense = nnx.All(wrt, row_grads_lib.NotTables(frozenset(self.keys)))
    if tx is None:
      names = _dense_names(model, dense)
      if names:
        raise ValueError(
            f"SparseAwareOptimizer: tx=None, but {names} are dense trainable "
            "parameters that nothing would update; pass an optax transformation "
            "as tx for them, or a wrt= filter that leaves them out to freeze them."
        )
    self.dense = None if tx is None else nnx.Optimizer(model, tx, wrt=dense)
    self.step = nnx.OptState(jnp.array(0, jnp.int32))
    slots = []
    for _, emb in found:
      arrays = apply_lib.init_slots(sparse, emb.plan, emb.mesh)
      specs = {k: apply_lib.slot_spec(s, emb.plan) for k, s in sparse.slots().items()}
      slots.append(nnx.Dict({k: _slot(v, specs[k], emb.mesh) for k, v in arrays.items()}))
    self.slots = nnx.List(slots)

  def update(self, model: nnx.Module, grads: row_grads_lib.Grads) -> None:
    """Applies one step: optax to ``grads.dense``, the rule to ``grads.rows``.

    Every sparse table counts a step, looked up or not, so schedules stay in
    step with the dense optimizer.

    Args:
      model: the model the optimizer was built for.
      grads: from ``embedlib.optim.value_and_grad``.
    """
    if not isinstance(grads, row_grads_lib.Grads):
      raise TypeError(
          f"SparseAwareOptimizer.update: grads is a {type(grads).__name__}, not "
          "the Grads of embedlib.optim.value_and_grad; take the gradients with it, "
          "which returns row gradients for the sparse "
          "tables (nnx.grad would build a table-sized gradient for each)."
      )
    unknown = sorted(set(grads.rows) - set(self.keys))
    if unknown:
      raise ValueError(
          f"SparseAwareOptimizer: row gradients for {unknown}, which are not "
          f"its sparse tables {list(self.keys)}; build the optimizer and "
          "value_and_grad with the same tables= selection."
      )
    if self.dense is not None:
      self.dense.update(model, grads.dense)
    step = self.step[...]
    found = dict(row_grads_lib.sparse_tables(model, self.tables))
    for key, slots in zip(self.keys, self.slots):
      pairs = grads.rows.get(key, ())
      if not pairs:
        continue
      emb = found[key]
      table, values = emb.physical_table(), {k: v[...] for k, v in slots.items()}
      # Eager on a mesh: one cached jit, not a compile of every op per call.
      apply = (_apply_jitted if embed_lib.eager_on_mesh(emb.mesh, table, values, pairs, step)
               else apply_lib.apply_row_grads)
      table, new = apply(
          self.rule, table, values, tuple(pairs), plan=emb.plan, mesh=emb.mesh, step=step
      )
      param_lib.set_physical(emb.embedding, table)
      for k, v in new.items():
        _compat.assign(slots[k], v)
    _compat.assign(self.step, step + 1)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("plan", "mesh"))
def _apply_jitted(rule, table, slots, pairs, *, plan, mesh, step):
  """``apply.apply_row_grads`` as one executable per rule, plan and shapes.

  Without donation: an eager caller may still hold the old table.
  """
  return apply_lib.apply_row_grads(rule, table, slots, pairs, plan=plan, mesh=mesh, step=step)


def _dense_names(model, dense) -> list[str]:
  """Paths of the variables of ``model`` that ``dense`` selects, the first three."""
  flat = nnx.to_flat_state(nnx.state(model, dense))
  names = ["/".join(str(p) for p in path) for path, _ in flat]
  return names[:3] + (["..."] if len(names) > 3 else [])


def _slot(value, spec, mesh):
  if mesh is None:
    return SparseSlot(value)
  # init_slots already laid the value out as spec says; flax's eager sharding
  # would copy it, a second slot per table while the optimizer is built.
  return SparseSlot(value, out_sharding=spec, mesh=mesh, eager_sharding=False)
