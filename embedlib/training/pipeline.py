"""The pipelined train step: step N's program also distributes batch N+1's ids.

In line, a step buckets (or gathers) and exchanges its ids only once it
starts, and its dense compute waits on them. Here the program that runs
step N also runs batch N+1's input distribution (sanitising, dedup, the
ids' all_to_all or all_gather: ``embedlib.lookahead``), which needs
nothing of step N, so a scheduler with async collectives can run it under
step N's compute; step N+1 reads its rows from what step N distributed.
The distribution is made by the operations the in-line lookup runs, so
training is the same bit for bit.

``Pipeline`` drives it over a data source that can look a batch ahead (its
position is recorded after each batch, so a checkpoint after step N
resumes at batch N+1 however far it read). Resuming needs nothing else:
the distribution is a function of the next batch alone, recomputed from
it (``distribute_batch``) at the first step after a restore.

A dynamic table's map (``embedlib.DynamicEmbed``) runs ahead too: its
admission and eviction depend on the ids alone, so step N's program steps
the map on batch N+1's ids from the map batch N's distribution carries,
and hands the rows' ids to the distribution. The model keeps batch N's map
during step N, which also resets the rows placed for batch N (and their
optimizer slots) after step N-1's update, as in line: a checkpoint after
step N holds the in-line run's map, and the map stepped on a read-ahead
batch that is never trained on is dropped with its distribution.
"""

from __future__ import annotations

from flax import nnx

from embedlib import dynamic, lookahead, optim


def _collect(loss, model, batch, early_fetch=0.0, previous=None):
  """``batch``'s ids distributed as ``loss`` looks them up, on a copy of ``model``.

  The copy's state changes (RNG counts, batch statistics) are dropped:
  the pass exists for its lookups' ids only. ``previous``: the batch
  before's distributions, whose dynamic tables' maps this batch's step from.
  """
  copy = nnx.merge(*nnx.split(model))
  with lookahead.collecting(early_fetch, previous) as distributions:
    loss(copy, batch)
  return distributions()


@nnx.jit(static_argnames=("task", "early_fetch"), graph_updates=False)
def distribute_batch(model, batch, *, task, early_fetch: float = 0.0) -> lookahead.Distributions:
  """The ids' distribution of ``batch``'s lookups: the first step's, and a resumed run's.

  Args:
    model: the model (only its tables' plans are read).
    batch: a global batch of ``task``'s layout.
    task: the ``Task`` whose ``loss`` looks the ids up.
    early_fetch: as ``pipelined_train_step``'s.

  Returns:
    A ``lookahead.Distributions`` for ``pipelined_train_step``.
  """
  return _collect(task.loss, model, batch, early_fetch)


@nnx.jit(donate_argnums=(0, 1, 3), static_argnames=("task", "early_fetch"))
def pipelined_train_step(model, optimizer, batch, distributed, next_batch, *, task,
                         early_fetch: float = 0.0):
  """``train_step`` on ``batch`` from its distributed ids, distributing ``next_batch``'s.

  Args:
    model: the model; its tables and other parameters change in place.
    optimizer: its ``SparseAwareOptimizer``.
    batch: this step's global batch.
    distributed: ``batch``'s ``lookahead.Distributions`` (from the previous
      step, or ``distribute_batch``); donated.
    next_batch: the next step's batch, of the same shapes (on the last
      step, any batch of them: its distribution is dropped).
    task: the ``Task`` whose ``loss`` is minimised.
    early_fetch: 0, or fetch the next batch's rows of routed and vocab
      tables in this step too, before its update, and bring the rows it
      changes up to date in the next step (the same result): the share
      (0, 1] of a route's slots (a vocab table's tokens per rank) the
      corrected rows may take before a step sends every row again.
      ``distributed`` must have been made with the same value.

  Returns:
    ``(loss, next_distributed)``: ``train_step``'s loss, the same bit for
    bit, and ``next_batch``'s distributions.
  """
  loss_fn = task.loss
  # No data flows from this step into the next batch's distribution, but
  # for the ids-only map of a dynamic table, which steps on from the map
  # this batch's distribution carries.
  next_distributed = _collect(loss_fn, model, next_batch, early_fetch, previous=distributed)
  with lookahead.using(distributed):
    loss, grads = optim.value_and_grad(loss_fn, tables=optimizer.tables)(model, batch)
  dynamic.reset_slots(optimizer, model)
  optimizer.update(model, grads)
  return loss, next_distributed


class LookaheadError(ValueError):
  """A pipelined step asked of a data source that can't look a batch ahead."""


def check_lookahead(source) -> None:
  """Raises ``LookaheadError`` unless ``source`` can be read one batch ahead.

  The pipelined loop reads batch N+1 before step N's checkpoint, which must
  record the position after batch N: the source needs ``get_state()`` and
  ``set_state()`` to rewind to it.
  """
  missing = [m for m in ("get_state", "set_state") if not callable(getattr(source, m, None))]
  if missing:
    raise LookaheadError(
        f"the pipelined train step reads batch N+1 during step N, so the data source must "
        f"record its position after batch N; {type(source).__name__} has no "
        f"{' or '.join(f'{m}()' for m in missing)}. Give it get_state() / set_state() (as "
        f"every embedlib.data source has), or train in line (config.pipeline=False, "
        f"embedlib.training.train_step).")


class Pipeline:
  """Runs ``pipelined_train_step`` over ``batches``, one batch ahead.

  Args:
    model: the model.
    optimizer: its ``SparseAwareOptimizer``.
    batches: an iterator of global batches with ``get_state()`` (the
      position after its last batch returned), e.g. a ``data.Prefetcher``
      of a source with ``get_state`` / ``set_state``.
    task: the ``Task`` each step minimises the ``loss`` of.
    early_fetch: ``pipelined_train_step``'s (0: ids only).
    source: the source ``batches`` reads, when ``batches`` is a wrapper of
      it (a ``Prefetcher``): checked for ``set_state`` too.

  Raises:
    LookaheadError: ``batches`` (or the source it prefetches) can't record
      its position (``check_lookahead``).
  """

  def __init__(self, model, optimizer, batches, task, *, early_fetch: float = 0.0,
               source=None):
    check_lookahead(batches if source is None else source)
    if not 0.0 <= early_fetch <= 1.0:
      raise ValueError(f"early_fetch={early_fetch}: the share of a route's slots for "
                       "corrected rows, in (0, 1]; 0 turns early fetch off.")
    self._static = {"task": task}
    if early_fetch:
      self._static["early_fetch"] = float(early_fetch)
    self._step = nnx.cached_partial(pipelined_train_step, model, optimizer)
    self._model = model
    self._batches = batches
    self._state = batches.get_state()  # the position after the last batch trained on
    self._next = next(batches, None)
    self._next_state = batches.get_state()
    self._distributed = None

  def get_state(self):
    """The data position after the last batch stepped on: what a checkpoint records."""
    return self._state

  def step(self):
    """One train step on the next batch; returns its loss.

    Raises:
      StopIteration: the batches ran out.
    """
    batch = self._next
    if batch is None:
      raise StopIteration
    if self._distributed is None:  # the first step, or the first after a restore
      self._distributed = distribute_batch(self._model, batch, **self._static)
    following = next(self._batches, None)
    state = self._next_state
    self._next_state = self._batches.get_state()
    loss, self._distributed = self._step(
        batch, self._distributed, batch if following is None else following, **self._static)
    self._next, self._state = following, state
    return loss
