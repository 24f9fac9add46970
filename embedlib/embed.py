"""``ShardedEmbed``: a drop-in ``nnx.Embed`` whose table is split over a mesh."""

from __future__ import annotations

import dataclasses
import functools
import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_embed_init
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import _deprecated
from embedlib import annotations
from embedlib import sharding as sharding_lib
from embedlib import table as table_lib
from embedlib import options
from embedlib import invalid_ids as invalid_lib
from embedlib import param as param_lib
from embedlib import kernels
from embedlib import logits as logits_lib
from embedlib import lookahead
from embedlib import strategies
from embedlib import tape as tape_lib
from embedlib.strategies import dedup
from embedlib.strategies import dispatch as dispatch_lib
from embedlib.strategies.request import Request
from embedlib.plan import check_shape, plan_embedding
from embedlib.plan.settings import Layout

def eager_on_mesh(mesh, *values) -> bool:
  """Whether a module call should run as one cached jit: eager, on a concrete mesh.

  Called eagerly, the mesh path would dispatch op by op and compile its
  ``shard_map`` and placements afresh on every call; jitted once per module
  structure and input shape, later calls reuse the executable. Not while a
  tape records lookups: it must see the caller's trace. ``values``: the
  call's inputs and tables (pytrees).
  """
  return (
      mesh is not None
      and sharding_lib.has_devices(mesh)
      and tape_lib.active() is None
      and not sharding_lib.any_tracer(*values)
  )


class ShardedEmbed(nnx.Module):
  """An embedding table laid out over a device mesh; a drop-in ``nnx.Embed``.

  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> import embedlib
  >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
  >>> emb = embedlib.ShardedEmbed(50257, 100, mesh=mesh, layout=embedlib.Layout(tied=True),
  ...                             rngs=nnx.Rngs(0))
  >>> emb.plan.strategy, emb.embedding.shape, emb.plan.padded_shape  # stored padded
  ('vocab', (50257, 100), (50260, 100))
  >>> ids = jnp.array([[0, 5, 50256], [7, -1, 3]])
  >>> emb(ids).shape
  (2, 3, 100)
  >>> bool(jnp.array_equal(emb(ids)[0], jnp.take(emb.logical_table(), ids[0], axis=0)))
  True
  >>> emb.attend(jnp.ones((2, 100))).shape
  (2, 50257)

  The table is split by vocabulary rows, by hidden columns, or not at all
  (``layout.sharding``), over ``layout.table_axes``; ids arrive with their
  leading (batch) dimension split over ``layout.data_axes``. Sizes that
  don't divide the group are padded: padded rows and columns are zero, get
  no gradient and never reach an output; ``logical_table()`` is the
  unpadded table. Every layout gives the single-device ``jnp.take`` answer.

  The table is drawn shard by shard: one jitted program calls
  ``embedding_init`` with the logical shape and pads, each device drawing
  only its own rows or columns (see ``embedlib.table``), with the values an
  ``nnx.Embed`` with the same ``rngs`` draws.

  Sharding annotations written for ``nnx.Embed`` are read as the layout
  request (see ``embedlib.annotations``): ``embedding_metadata=
  {'out_sharding': spec}`` or ``embedding_init=nnx.with_partitioning(init,
  axes)``, with mesh axes or logical names under ``nnx.logical_axis_rules``.
  Mesh axes on the vocabulary dimension mean vocab sharding over them, on
  the feature dimension hidden sharding, none ``"auto"``; a ``sharding``
  and ``table_axes`` in ``layout`` must agree with it. The parameter's
  ``out_sharding`` is the physical spec (of its raw value, what ``jit``
  sees).

  ``embedding`` reads and writes as ``nnx.Embed``'s does: ``[...]``, any
  index, ``get_value()``, ``.shape``, ``.T``, arithmetic, ``set_value``,
  ``nnx.state`` leaves, gradients and ``nnx.bridge.to_linen`` give and take
  the logical table; a padded table's parameter is an ``nnx.Param`` of its
  own type for that (``embedlib.param.TableParam``). It is stored padded:
  ``plan.padded_shape``, its raw value (``embedding.get_raw_value()``,
  ``physical_table()``), what ``nnx.split``, optax and checkpoints hold.

  Differences from ``nnx.Embed``: an invalid id (negative or
  ``>= num_embeddings``) looks up zeros with zero gradient, where
  ``nnx.Embed`` returns NaN or wraps (see ``embedlib.invalid_ids``), and
  where the table is padded, ``emb.embedding[rows] = x`` raises: write the
  whole table, ``emb.embedding[...] = emb.embedding[...].at[rows].set(x)``.
  ``promote_dtype`` is an attribute to set (``emb.promote_dtype = fn``, as
  on an ``nnx.Embed``) rather than an argument.

  Args:
    num_embeddings: vocabulary size.
    features: embedding width.
    mesh: a ``Mesh`` or ``AbstractMesh``; None takes the one set with
      ``jax.set_mesh``, or one device when there is none.
    layout: an ``embedlib.Layout``: the layout to use or let the planner
      choose (``sharding``, ``table_axes``, ...), the route's capacities,
      the local kernel and the invalid-id rule. None: all chosen for you.
      The keywords it replaces (``sharding=``, ``tied=``, ...) still work
      until embedlib 0.2, with a ``DeprecationWarning``.
    name: the table's name in plans and error messages.
    dtype: dtype of the outputs (default: ``param_dtype``).
    param_dtype: dtype of the stored table.
    embedding_init: initializer, called with the logical shape; may carry
      a sharding annotation (``nnx.with_partitioning``).
    embedding_metadata: extra ``nnx.Param`` metadata; its ``out_sharding``
      is read as a sharding annotation.
    rngs: random number generators; ``rngs.params()`` draws the table.
  """

  @_deprecated.moved_keywords(
      "ShardedEmbed", {"layout": (Layout, "embedlib.Layout")},
      attributes={"promote_dtype": "set emb.promote_dtype = fn after construction, as on "
                                   "an nnx.Embed"})
  def __init__(
      self,
      num_embeddings: int,
      features: int,
      *,
      mesh=None,
      layout: Layout | None = None,
      name: str = "embedding",
      dtype: tp.Any = None,
      param_dtype: tp.Any = jnp.float32,
      embedding_init: tp.Callable = default_embed_init,
      embedding_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
      rngs: nnx.Rngs,
  ):
    layout = Layout() if layout is None else layout
    if not isinstance(layout, Layout):
      raise TypeError(f"{name}: layout={layout!r}; pass an embedlib.Layout(...) or None.")
    if layout.invalid_ids not in invalid_lib.MODES:
      raise ValueError(
          f"{name}: invalid_ids={layout.invalid_ids!r}; use one of {invalid_lib.MODES}."
      )
    kernels.resolve_kernel(layout.kernel)  # fail early on an unknown kernel name
    if layout.on_overflow not in dedup.OVERFLOW_MODES:
      raise ValueError(
          f"{name}: on_overflow={layout.on_overflow!r}; use one of {dedup.OVERFLOW_MODES}."
      )
    shape = check_shape(num_embeddings, features, name)
    key = rngs.params()
    box = annotations.init_box(embedding_init, key, shape, param_dtype, name=name)
    found = annotations.find(embedding_metadata, box)
    mesh = sharding_lib.mesh_or_current(mesh)
    request = annotations.read(
        found, None if mesh is None else tuple(mesh.axis_names), name=name)
    if mesh is None and request is not None:
      mesh = request.mesh
    sharding, table_axes, column_axes = annotations.merge(
        layout.sharding, layout.table_axes, request, name=name, column_axes=layout.column_axes)
    planned = dict(layout.planner_settings(), sharding=sharding, table_axes=table_axes,
                   column_axes=column_axes)
    self.plan = plan_embedding(num_embeddings, features, mesh=mesh, param_dtype=param_dtype,
                               name=name, **planned)
    self.mesh = mesh
    self.on_overflow = layout.on_overflow
    self.num_embeddings = self.plan.num_embeddings
    self.features = self.plan.features
    self.kernel = layout.kernel
    self.invalid_ids = layout.invalid_ids
    self.param_dtype = param_dtype
    self.promote_dtype = dtypes.promote_dtype
    table = table_lib.draw(embedding_init, key, self.plan, mesh, param_dtype,
                           unwrap=annotations.unwrap)
    metadata, box = annotations.param_metadata(
        embedding_metadata, box, spec=self.plan.table_spec, mesh=mesh,
        annotated=found is not None)
    value = table if box is None else dataclasses.replace(box, raw_value=table)
    self.embedding = param_lib.make(value, self.plan, mesh, metadata)
    self.dtype = dtype or self.embedding.dtype

  # -- the table ---------------------------------------------------------

  def _sharding(self):
    return table_lib.physical_sharding(self.plan, self.mesh)

  def physical_table(self) -> jax.Array:
    """The stored table: ``plan.padded_shape``, laid out by ``plan.table_spec``.

    What lookups, the sparse optimizers and checkpoints read; the parameter
    itself presents the logical table (``embedlib.param``).
    """
    return param_lib.physical(self.embedding, self.plan, self.mesh)

  def logical_table(self, *, replicated: bool = False) -> jax.Array:
    """The unpadded ``(num_embeddings, features)`` table.

    Kept split over the mesh: without padding it is the parameter itself;
    with padding it is laid out by ``plan.logical_spec`` (the even split over
    the most devices, since an array can't be split unevenly). No device
    holds it whole unless no mesh axis divides either size, or
    ``replicated=True`` gathers it onto every device.
    """
    return table_lib.unpad(self.physical_table(), self.plan, self.mesh, replicated=replicated)

  def load_table(self, table) -> None:
    """Sets the parameter from a logical ``(num_embeddings, features)`` table.

    ``table`` is a host array (numpy, ``np.memmap``, nested lists) or a jax
    array; a host array is read one shard at a time, so the padded table is
    never whole on one device (or the host) unless it is replicated. Values
    are cast to ``param_dtype``.

    >>> from flax import nnx
    >>> emb = ShardedEmbed(3, 2, rngs=nnx.Rngs(0))
    >>> emb.load_table(jnp.arange(6.0).reshape(3, 2))
    >>> emb(jnp.array([2]))
    Array([[4., 5.]], dtype=float32)

    Raises:
      ValueError: a table of another shape, of a complex or non-numeric
        dtype, or holding values that overflow ``param_dtype`` to inf.
    """
    table = table_lib.check_host_table(table, self.plan, self.param_dtype)
    param_lib.set_physical(self.embedding,
                           table_lib.load(table, self.plan, self.mesh, self.param_dtype))

  def _stored(self):
    """The stored table's raw value (a pytree), for the eager-call test."""
    return self.embedding.get_raw_value()

  # -- lookups -----------------------------------------------------------

  def _local_kernels(self) -> dict:
    """The strategies' local ``gather`` and ``bag`` kernels and their ``check_vma``."""
    return dict(gather=functools.partial(kernels.gather, kernel=self.kernel),
                bag=functools.partial(kernels.bag, kernel=self.kernel),
                check_vma=kernels.shard_map_check_vma(self.kernel))

  def __call__(self, inputs, out_sharding=None) -> jax.Array:
    """Embeds integer ids: ``inputs.shape + (features,)``.

    Args:
      inputs: int ids of any shape and integer dtype; the leading dimension
        is the batch.
      out_sharding: optional ``PartitionSpec`` or ``Sharding`` of the output.

    Returns:
      The embeddings, in ``dtype``.
    """
    ids = _integers(inputs, self.plan.name)
    flat = ids.reshape(ids.shape or (1,))
    (out,) = self.lookup_requests((Request(flat),))
    return self._reshard(out.reshape(ids.shape + (self.features,)), out_sharding)

  def bag(self, ids, weights=None, *, combiner: str = "sum", out_sharding=None) -> jax.Array:
    """Pooled lookup of padded bags: ``[batch, bag]`` ids to ``[batch, features]``.

    No ``[batch, bag, features]`` intermediate: each rank pools its rows
    with the bag kernel and only pooled rows are communicated.

    >>> from flax import nnx
    >>> emb = ShardedEmbed(3, 2, rngs=nnx.Rngs(0))
    >>> emb.load_table(jnp.arange(6.0).reshape(3, 2))
    >>> emb.bag(jnp.array([[0, 2, -1]]), combiner="mean")
    Array([[2., 3.]], dtype=float32)

    Args:
      ids: int ``[batch, bag]``, padded with ``-1`` (any invalid id is
        padding; with ``invalid_ids="error"`` only ``-1`` is).
      weights: optional float ``[batch, bag]`` per-id weights.
      combiner: ``"sum" | "mean" | "sqrtn"`` over each bag's valid ids.
      out_sharding: optional ``PartitionSpec`` or ``Sharding`` of the output.

    Returns:
      ``[batch, features]``, in ``dtype``.
    """
    ids = _integers(ids, self.plan.name)
    weights = None if weights is None else jnp.asarray(weights)
    (out,) = self.lookup_requests((Request(ids, weights, combiner),))
    return self._reshard(out, out_sharding)

  def lookup_requests(self, requests, *, num_unique: int | None = None,
                      on_overflow: str | None = None, checks: list | None = None) -> tuple:
    """Several lookups of this table at once, optionally with id dedup.

    The path every lookup of the table takes (``__call__``, ``bag`` and
    ``EmbeddingCollection``): sanitising, kernel choice, the strategy, the
    report to an ``embedlib.optim`` tape, and the cached jit of an eager
    call on a mesh.

    Args:
      requests: ``Request`` s; with ``num_unique``, ids ``[batch]`` or
        ``[batch, bag]`` sharing the batch.
      num_unique: None, or look each data shard's distinct ids (over all
        requests) up once, at most this many (see
        ``embedlib.strategies.dedup``).
      on_overflow: ``"fallback"`` or ``"error"``, for a shard holding more
        than ``num_unique`` distinct ids or a rank routing more ids to one
        owner than the route capacity; None takes the module's.
      checks: None runs this call's checks (``invalid_ids="error"``, dedup
        and route overflow) after its lookups; a list receives them instead, as
        callables, for a caller with more lookups to run them after its
        last one: a traced check must follow every ``shard_map`` of the
        jitted function (see ``sharding.no_context_mesh``).

    Returns:
      One output per request: ``ids.shape + (features,)`` unpooled,
      ``[batch, features]`` pooled, in ``dtype``.
    """
    raw = [_integers(r.ids, self.plan.name) for r in requests]
    for ids, r in zip(raw, requests):
      r.check_bag(self.plan.name, ids.shape)
    requests = tuple(r.replace(ids=self._sanitize(ids, r.pooled))
                     for ids, r in zip(raw, requests))
    on_overflow = on_overflow or self.on_overflow
    if eager_on_mesh(self.mesh, requests, self._stored()):
      out, overflow = _eager_requests(self, requests, num_unique, on_overflow)
    else:
      out, overflow = self._lookup_requests(requests, num_unique, on_overflow)
    if lookahead.is_collecting(lookahead.active()):
      # A batch read ahead: its step checks it when it looks it up.
      return out
    # Traced checks come after the lookups, whose shard_maps they would
    # otherwise precede (see sharding.no_context_mesh).
    deferred = []
    if on_overflow == dedup.ERROR:
      deferred += [functools.partial(dedup.check_capacity, need, capacity, self.plan.name, what)
                   for what, (need, capacity) in overflow.items()]
    if self.invalid_ids == invalid_lib.ERROR:
      deferred += [functools.partial(invalid_lib.check, ids, self.num_embeddings,
                                     self.plan.name, padding=r.pooled)
                   for ids, r in zip(raw, requests) if isinstance(ids, jax.core.Tracer)]
    if checks is None:
      for check in deferred:
        check()
    else:
      checks.extend(deferred)
    return out

  def distinct_ids_per_shard(self, requests) -> int:
    """The most distinct valid ids any data shard holds over ``requests``.

    The ``num_unique`` these requests need (concrete ids only).
    """
    ids = jnp.concatenate(
        [dedup.as_2d(self._sanitize(_integers(r.ids, self.plan.name))) for r in requests], axis=1
    )
    return int(_max_unique(ids, plan=self.plan, mesh=self.mesh))

  def _sanitize(self, ids, pooled=False):
    """Ids of any integer dtype as int32, ``-1`` for every invalid id.

    Raises at once for invalid concrete ids under ``invalid_ids="error"``
    (``-1`` in a pooled bag is padding, not an error); traced ones are
    checked after the lookup (``lookup_requests``).
    """
    if self.invalid_ids == invalid_lib.ERROR and not isinstance(ids, jax.core.Tracer):
      invalid_lib.check(ids, self.num_embeddings, self.plan.name, padding=pooled)
    return invalid_lib.sanitize(invalid_lib.as_ids(ids, self.num_embeddings),
                                self.num_embeddings)

  def _lookup_requests(self, requests, num_unique, on_overflow):
    table = self.physical_table()
    run = dict(plan=self.plan, mesh=self.mesh, **self._local_kernels())
    scope = lookahead.active()
    if scope is None:
      out, overflow = strategies.lookup_requests(
          table, requests, num_unique=num_unique, on_overflow=on_overflow, **run
      )
    else:
      out, overflow = self._lookup_ahead(scope, table, requests, num_unique, on_overflow, run)
    tape = tape_lib.active()
    if tape is not None:
      # Outside the dedup lax.cond: a tape records traced ids, which must not
      # leak out of a branch.
      out = tuple(
          tape.lookup(self, r.ids, o, kernels.bag_coefficients(
              r.ids, r.weights, self.num_embeddings, r.combiner) if r.pooled else None)
          for r, o in zip(requests, out)
      )
    return tuple(
        self.promote_dtype((o,), dtype=self.dtype, inexact=False)[0] for o in out
    ), overflow

  def _lookup_ahead(self, scope, table, requests, num_unique, on_overflow, run):
    """A lookup under a pipelined step's scope (``embedlib.lookahead``).

    Collecting, only the ids move (zero rows come back); using, the rows are
    read from the distribution collected for these requests.
    """
    def collect(scope):
      distribution = strategies.distribute(
          requests, plan=self.plan, mesh=self.mesh, num_unique=num_unique,
          check_vma=run["check_vma"], table=table, gather=run["gather"],
          early_fetch=scope.early_fetch)
      return distribution, (tuple(dispatch_lib.no_rows(r, self.plan, self.mesh, table.dtype)
                                  for r in requests), {})

    def use(distribution):
      return strategies.finish(table, requests, distribution, num_unique=num_unique,
                               on_overflow=on_overflow, **run)

    key = lookahead.request_key(self.plan.name, requests, num_unique, on_overflow)
    return lookahead.read_ahead(scope, key, collect, use)

  def attend(self, query, out_sharding=None):
    """``query @ logical_table.T``: exactly ``num_embeddings`` logits.

    An ``out_sharding`` that splits the last (vocabulary) dimension asks for
    vocab-parallel logits, the input of ``vocab_parallel_cross_entropy``:

    - on a vocab-sharded table split over exactly ``plan.table_axes`` (in
      that order), each device keeps the logits of its own rows: no
      all-gather or all-to-all of logits, no device ever holds a token's
      whole row of logits (only the token dimension is then moved, if the
      request splits it differently from the query);
    - otherwise the logits are made as without ``out_sharding`` and each
      device keeps its block: a hidden-sharded table sums its partial
      logits (all-reduce) and a replicated one computes them whole, so
      neither gathers, but each device holds all its tokens' logits on the
      way; a vocab-sharded table asked for a split over other axes than
      its own concatenates them first (all-gather or all-to-all).

    When the split divides ``num_embeddings`` the result is a ``jax.Array``
    laid out as asked, as ``nnx.Embed.attend`` gives it. When it doesn't
    (50257 over 4), jax can't split an array unevenly, so the result is an
    ``embedlib.VocabShardedLogits``: the logits padded to a multiple of the
    split (as the table is) with ``shape`` the logical one; its padded
    columns are never logits (``vocab_parallel_cross_entropy`` masks them,
    ``unpadded()`` strips them).

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4])
    >>> emb = ShardedEmbed(99, 8, mesh=mesh, layout=Layout(sharding="vocab"), rngs=nnx.Rngs(0))
    >>> logits = emb.attend(jnp.ones((3, 8)), out_sharding=P(None, "model"))
    >>> type(logits).__name__, logits.shape, logits.padded.shape
    ('VocabShardedLogits', (3, 99), (3, 100))

    Args:
      query: ``[..., features]``; the leading dimension is the batch.
      out_sharding: optional ``PartitionSpec`` (on the module's mesh) or
        ``NamedSharding`` of the output, one entry per output dimension.

    Returns:
      ``[..., num_embeddings]`` logits, or a ``VocabShardedLogits`` of that
      shape (above).
    """
    query = jnp.asarray(query)
    if query.shape[-1:] != (self.features,):
      raise ValueError(
          f"{self.plan.name}: attend needs a query whose last dimension is "
          f"features={self.features}, got shape {query.shape}."
      )
    if eager_on_mesh(self.mesh, query, self._stored()):
      return _eager_attend(self, query, out_sharding)
    return self._attend(query, out_sharding)

  def _attend(self, query, out_sharding):
    if tape_lib.active() is not None:
      tape_lib.active().attend(self)
    query, table, scores = self._attend_operands(query)
    flat = query.reshape(query.shape if query.ndim > 1 else (1,) + query.shape)
    sharding = None if out_sharding is None else self._named(out_sharding)
    split = sharding is not None and self._keeps_vocab_blocks(sharding, query.ndim)
    attend = strategies.attend_vocab_split if split else strategies.attend
    out = attend(table, flat, plan=self.plan, mesh=self.mesh, scores=scores)
    out = out.reshape(query.shape[:-1] + out.shape[-1:])
    if not isinstance(sharding, NamedSharding):
      return self._reshard(out, sharding)
    return logits_lib.place_logits(out, self.num_embeddings, sharding, self.plan.name)

  def _attend_operands(self, query):
    """``attend``'s promoted query and table, and the local ``query @ table.T``."""
    query, table = self.promote_dtype((query, self.physical_table()), dtype=self.dtype)
    return query, table, kernels.scores

  def _keeps_vocab_blocks(self, sharding, ndim):
    """Whether ``attend`` can leave each rank its own rows' logits for ``sharding``."""
    return (
        self.mesh is not None
        and self.plan.strategy in options.ROW_BLOCKS
        and isinstance(sharding, NamedSharding)
        and logits_lib.vocab_axes_of(sharding, ndim, self.plan.name) == self.plan.table_axes
    )

  def _named(self, out_sharding):
    """``out_sharding`` as a ``Sharding`` (a ``PartitionSpec`` is on the module's mesh)."""
    if isinstance(out_sharding, P):
      if self.mesh is None:
        raise ValueError(
            f"{self.plan.name}: out_sharding={out_sharding} needs a mesh; pass "
            "mesh= or a NamedSharding."
        )
      return NamedSharding(self.mesh, out_sharding)
    return out_sharding

  def _reshard(self, out, out_sharding):
    if out_sharding is None:
      return out
    return sharding_lib.place_always(out, self._named(out_sharding))


def _integers(ids, name):
  """``ids`` as an array (host ids stay numpy, in full precision), integers only."""
  ids = ids if isinstance(ids, jax.Array) else np.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(  # nnx.Embed's words first, for code that matches them
        f"Input type must be an integer or unsigned integer: table {name!r} "
        f"got {ids.dtype} ids; cast them with .astype(jnp.int32)."
    )
  return ids


# The eager paths of `eager_on_mesh`: jit caches key on the module's structure
# (plan, mesh, kernel: in its graph definition), the inputs' shapes and the
# static options.
_eager_requests = nnx.jit(ShardedEmbed._lookup_requests, static_argnums=(2, 3))
_eager_attend = nnx.jit(ShardedEmbed._attend, static_argnums=2)


@functools.partial(jax.jit, static_argnames=("plan", "mesh"))
def _max_unique(ids, *, plan, mesh):
  # Jitted: an eager shard_map runs op by op, far slower than one compile.
  ids = sharding_lib.pad_tokens(ids, plan.data_shards, -1)
  capacity = ids.size // plan.data_shards  # can't overflow
  _, _, counts = dedup.unique_per_shard(ids, capacity, plan=plan, mesh=mesh)
  return jnp.max(counts)
