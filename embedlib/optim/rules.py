"""Row-wise update rules: the math applied to each touched row, nothing else.

A rule sees only the rows a batch touched, one per distinct id, with their
gradient already summed over every occurrence of the id (duplicates count
once, with the sum). It declares its optimizer slots and, for a block of
touched rows, returns their increment and new slots; ``apply.py`` finds
the rows, runs the rule on the shard that owns them and writes them back.
Rows the batch did not touch keep their values and slots unchanged: the
"lazy" semantics of PyTorch's ``SparseAdam``, TensorFlow's ``LazyAdam`` and
FBGEMM's fused optimizers, which differs from running the dense optax rule on a gradient
that is zero outside the batch (which would decay Adam moments and advance
bias corrections on every row, every step).

Slots come in two kinds: ``"table"`` slots have one value per table element
(``[padded_rows, padded_features]``, laid out exactly like the table) and
``"row"`` slots one value per row (``[padded_rows]``, split like the table's
rows for vocab sharding and whole on every rank otherwise, so a
hidden-sharded rank updates them without communication). Slots are float32
(int32 for step counts) whatever the table's dtype, as in FBGEMM.

The learning rate is a float or an optax schedule; a schedule is called with
the number of updates applied before this one (0 first), like
``optax.scale_by_schedule``.
"""

from __future__ import annotations

import dataclasses
import numbers
import typing as tp

import jax
import jax.numpy as jnp

#: Slot kinds: one value per table element, or one per row.
TABLE = "table"
ROW = "row"

ScalarOrSchedule = tp.Union[float, tp.Callable[[jax.Array], jax.Array]]


@dataclasses.dataclass(frozen=True)
class Slot:
  """One optimizer slot: its kind (``"table"`` or ``"row"``), dtype and initial value."""

  kind: str
  dtype: tp.Any = jnp.float32
  init: float = 0.0


def _real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


class RowRule:
  """Base of the row-wise rules; subclasses set ``learning_rate`` and the math."""

  learning_rate: ScalarOrSchedule

  def __post_init__(self):
    name = type(self).__name__
    lr = self.learning_rate
    if not (callable(lr) or _real(lr)):
      raise TypeError(
          f"{name}: learning_rate={lr!r} is neither a number nor a schedule; pass "
          "a float, or an optax schedule (a function of the step count)."
      )
    # Hyperparameters a rule divides by or takes a root of: a negative one
    # can make touched rows inf or NaN on the first step, silently.
    for field in ("eps", "initial_accumulator_value"):
      value = getattr(self, field, 0.0)
      if not _real(value) or value < 0:
        raise ValueError(f"{name}: {field}={value!r}; pass a number >= 0.")
    for field in ("b1", "b2"):
      value = getattr(self, field, 0.0)
      if not _real(value) or not 0 <= value < 1:
        raise ValueError(
            f"{name}: {field}={value!r}; a moment's decay must be in [0, 1) "
            "(Adam's defaults are b1=0.9, b2=0.999)."
        )

  def slots(self) -> dict[str, Slot]:
    """The slots this rule keeps per table, by name."""
    return {}

  def lr(self, step) -> jax.Array:
    """The learning rate of the update that follows ``step`` earlier updates."""
    if callable(self.learning_rate):
      return jnp.asarray(self.learning_rate(step), jnp.float32)
    return jnp.asarray(self.learning_rate, jnp.float32)

  def update(self, slots, grads, *, row_sq_mean, lr, step):
    """The increment of touched rows, and their new slots.

    Rules see slots and gradients, not the weights: the update adds the
    increment to the rows without reading them (a rule with weight decay
    would need the rows too; none here has it).

    Each output row must depend only on its own row's inputs (and the
    scalars): ``apply.py`` also passes filler rows (a zero gradient,
    zero-filled slots), for the padding of its static shapes and, on small
    tables, every row no id touched, and drops their results, so whatever
    a rule computes for them (even NaN) never reaches the table.

    Args:
      slots: slot name -> ``[u, width]`` (table slots) or ``[u]`` (row slots).
      grads: ``[u, width]`` float32, the summed gradient of each touched row
        (zero in padded columns).
      row_sq_mean: ``[u]``, the mean of ``g ** 2`` over the row's logical
        ``features`` columns (the whole row, also on a hidden-sharded rank).
      lr: scalar learning rate of this step.
      step: int32 scalar, updates applied before this one.

    Returns:
      ``(increment, slots)``: ``[u, width]`` to add to the rows, and the
      slots in the shapes given.
    """
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class SparseSGD(RowRule):
  """Row-sparse SGD: ``w[r] -= lr * g[r]`` for each touched row ``r``.

  >>> import jax.numpy as jnp
  >>> rule = SparseSGD(learning_rate=0.5)
  >>> step, _ = rule.update({}, jnp.array([[2.0, 4.0]]), row_sq_mean=None,
  ...                       lr=rule.lr(0), step=0)
  >>> step.tolist()
  [[-1.0, -2.0]]

  Args:
    learning_rate: a float or an optax schedule of the step count.
  """

  learning_rate: ScalarOrSchedule = 0.01

  def update(self, slots, grads, *, row_sq_mean, lr, step):
    del row_sq_mean, step
    return -lr * grads, slots


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad(RowRule):
  """Row-wise AdaGrad: one accumulator per row (FBGEMM ``EXACT_ROWWISE_ADAGRAD``).

  For each touched row ``r`` with summed gradient ``g`` (``features`` wide)::

      acc[r] += mean(g ** 2)                       # over the logical columns
      w[r]   -= lr * g / (sqrt(acc[r]) + eps)

  The mean is over the row's ``features`` logical columns, never the padded
  ones, so padding a hidden-sharded table does not change the update. The
  accumulator is a ``[padded_rows]`` row slot; with ``acc`` starting at 0
  the first update of a row moves it by about ``lr * g / rms(g)``. FBGEMM and
  TorchRec default to ``eps=1e-8`` and an initial accumulator of 0; optax's
  element-wise ``adagrad`` uses 0.1 and 1e-7.

  >>> import jax.numpy as jnp
  >>> rule = RowWiseAdagrad(learning_rate=1.0, eps=0.0)
  >>> g = jnp.array([[3.0, 4.0]])            # mean(g**2) = 12.5
  >>> step, slots = rule.update({"acc": jnp.zeros(1)}, g,
  ...                           row_sq_mean=jnp.array([12.5]), lr=1.0, step=0)
  >>> slots["acc"].tolist(), [round(x, 4) for x in step[0].tolist()]
  ([12.5], [-0.8485, -1.1314])

  Args:
    learning_rate: a float or an optax schedule of the step count.
    eps: added to ``sqrt(acc)``.
    initial_accumulator_value: starting value of every row's accumulator.
  """

  learning_rate: ScalarOrSchedule = 0.01
  eps: float = 1e-8
  initial_accumulator_value: float = 0.0

  def slots(self):
    return {"acc": Slot(ROW, jnp.float32, self.initial_accumulator_value)}

  def update(self, slots, grads, *, row_sq_mean, lr, step):
    del step
    acc = slots["acc"] + row_sq_mean
    scale = lr / (jnp.sqrt(acc) + self.eps)
    return -scale[:, None] * grads, {"acc": acc}


@dataclasses.dataclass(frozen=True)
class LazyAdam(RowRule):
  """Adam whose moments and bias corrections advance only on touched rows.

  For each touched row ``r`` with summed gradient ``g``::

      m[r] = b1 * m[r] + (1 - b1) * g
      v[r] = b2 * v[r] + (1 - b2) * g ** 2
      t    = count[r] + 1  (bias_correction="row")  or  step + 1  ("global")
      w[r] -= lr * (m[r] / (1 - b1 ** t)) / (sqrt(v[r] / (1 - b2 ** t)) + eps)

  ``m`` and ``v`` are table slots. ``bias_correction="row"`` (default) keeps
  a ``[padded_rows]`` int32 count of the updates each row has had, so a row
  first seen at step 10,000 gets the full first-step correction instead of
  none; ``"global"`` uses the optimizer's step, as PyTorch ``SparseAdam``
  and TensorFlow ``LazyAdam`` do, and keeps no count. With every row touched
  every step both equal ``optax.adam`` (``eps_root=0``).

  >>> import jax.numpy as jnp
  >>> rule = LazyAdam(learning_rate=0.1)
  >>> sorted(rule.slots())
  ['count', 'm', 'v']
  >>> z = jnp.zeros((1, 2))
  >>> step, _ = rule.update({"m": z, "v": z, "count": jnp.zeros(1, jnp.int32)},
  ...                       jnp.array([[2.0, -3.0]]), row_sq_mean=None, lr=0.1, step=0)
  >>> [round(x, 4) for x in step[0].tolist()]      # first step: -lr * sign(g)
  [-0.1, 0.1]

  Args:
    learning_rate: a float or an optax schedule of the step count.
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the root of the corrected second moment.
    bias_correction: ``"row"`` or ``"global"`` (see above).
  """

  learning_rate: ScalarOrSchedule = 0.001
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  bias_correction: str = "row"

  def __post_init__(self):
    super().__post_init__()
    if self.bias_correction not in ("row", "global"):
      raise ValueError(
          f"LazyAdam: bias_correction={self.bias_correction!r}; use 'row' "
          "(a step count per row) or 'global' (the optimizer's step)."
      )

  def slots(self):
    out = {"m": Slot(TABLE), "v": Slot(TABLE)}
    if self.bias_correction == "row":
      out["count"] = Slot(ROW, jnp.int32, 0)
    return out

  def update(self, slots, grads, *, row_sq_mean, lr, step):
    del row_sq_mean
    m = self.b1 * slots["m"] + (1 - self.b1) * grads
    v = self.b2 * slots["v"] + (1 - self.b2) * grads * grads
    new = {"m": m, "v": v}
    if self.bias_correction == "row":
      new["count"] = slots["count"] + 1
      t = new["count"].astype(jnp.float32)[:, None]
    else:
      t = jnp.asarray(step, jnp.float32) + 1
    m_hat = m / (1 - self.b1**t)
    v_hat = v / (1 - self.b2**t)
    return -lr * m_hat / (jnp.sqrt(v_hat) + self.eps), new
