"""`quantize`: a trained table, collection or model, its tables quantized for inference.

A `QuantizedEmbed` keeps the float module's plan, mesh, kernel option and
invalid-id rule, and replaces its parameter with a `format.QuantizedTable`
laid out by the same ``plan.table_spec``: the codes ``[padded rows, ...]``
and the ``[padded rows, blocks, 2]`` scales and biases split over the same
row (and column) axes, one block per column shard (hidden and grid layouts
quantize each column shard's slice of a row on its own; the 1-D row layouts
and replicated tables have one block a row). The strategies carry it as they
carry a float table; only the kernels (`lookup`, and `scores` for
``attend``) read inside, so every layout's result is the float lookup (or
logits) of the dequantized table, padding included as invisibly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embedlib import sharding as sharding_lib
from embedlib import table as table_lib
from embedlib import tape as tape_lib
from embedlib.embed import ShardedEmbed
from embedlib.quant import format as fmt
from embedlib.quant import lookup
from embedlib.quant import scores as scores_lib


class QuantizedTableVariable(nnx.Variable):
  """Holds a `format.QuantizedTable`: not an ``nnx.Param``, so no optimizer or grad reaches it."""


def _blocks(plan) -> int:
  return plan.padded_shape[1] // plan.shard_shape[1]


def _quantize_physical(table, plan, mesh, bits, scale_dtype):
  """The physical table quantized shard by shard, laid out as ``plan.table_spec``."""
  blocks = _blocks(plan)
  run = functools.partial(fmt.quantize_table, bits=bits, scale_dtype=scale_dtype,
                          blocks=blocks)
  spec = None if mesh is None else NamedSharding(mesh, P(*plan.table_spec))
  shapes = jax.eval_shape(run, table)
  if isinstance(table, jax.ShapeDtypeStruct):  # an abstract module (ahead-of-time lowering)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=spec), shapes)
  if spec is None or not sharding_lib.has_devices(mesh):
    return jax.jit(run)(table)
  return jax.jit(run, out_shardings=jax.tree.map(lambda _: spec, shapes))(table)


class QuantizedEmbed(ShardedEmbed):
  """A ``ShardedEmbed`` whose table is quantized: inference lookups only.

  Build it with `quantize`. ``__call__``, ``bag`` and ``lookup_requests``
  work as the float module's (every layout, kernel and invalid-id rule) and
  return ``dtype``; their rows are the float lookup's of ``dequantized()``.
  ``attend`` (a tied output layer: SASRec's, HSTU's logits) scores every
  row from its codes, in every layout and with ``out_sharding`` as the
  float module's, within float32 rounding of the float attend of
  ``dequantized()`` (`scores`). Gradients and the sparse optimizers' tape
  raise.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> q = quantize(ShardedEmbed(99, 8, tied=True, rngs=nnx.Rngs(0)), bits=4)
  >>> logits = q.attend(jnp.ones((2, 8)))
  >>> logits.shape, bool(jnp.allclose(logits, jnp.ones((2, 8)) @ q.dequantized().T, atol=1e-5))
  ((2, 99), True)

  Attributes:
    table: a `QuantizedTableVariable` holding the `format.QuantizedTable`.
    bits: its format (one of ``format.FORMATS``).
  """

  def __init__(self, source: ShardedEmbed, *, bits=fmt.INT8, scale_dtype=jnp.float16):
    fmt.check_format(bits, scale_dtype)
    for name in ("plan", "mesh", "on_overflow", "num_embeddings", "features", "kernel",
                 "invalid_ids", "param_dtype", "promote_dtype", "dtype"):
      setattr(self, name, getattr(source, name))
    self.bits = bits
    self.table = QuantizedTableVariable(_quantize_physical(
        source.physical_table(), self.plan, self.mesh, bits, scale_dtype))

  @property
  def nbytes(self) -> int:
    """Bytes of the stored (padded) quantized table."""
    return self.table.get_value().nbytes

  def physical_table(self) -> fmt.QuantizedTable:
    return self.table.get_value()

  def _stored(self):
    return self.table.get_value()

  def _local_kernels(self) -> dict:
    return dict(gather=functools.partial(lookup.gather, kernel=self.kernel),
                bag=functools.partial(lookup.bag, kernel=self.kernel),
                check_vma=lookup.check_vma(self.kernel))

  def lookup_requests(self, requests, **kw):
    if tape_lib.active() is not None:
      raise ValueError(f"{self.plan.name}: {lookup.TRAINING_ERROR}")
    return super().lookup_requests(requests, **kw)

  def dequantized(self) -> jax.Array:
    """The logical float32 table the lookups read (tests and checks: it builds the whole table)."""
    full = fmt.dequantize(self.physical_table())
    if self.mesh is None:
      return full[: self.num_embeddings, : self.features]
    full = sharding_lib.place_always(full, NamedSharding(self.mesh, P(*self.plan.table_spec)))
    return table_lib.unpad(full, self.plan, self.mesh)

  def attend(self, query, out_sharding=None):
    """``query @ dequantized().T``: ``ShardedEmbed.attend`` of the quantized table.

    Every layout and ``out_sharding`` as the float module's (exactly
    ``num_embeddings`` logits, vocab-parallel blocks, a
    ``VocabShardedLogits`` for a split that doesn't divide the vocabulary);
    each shard scores its own codes (`scores.scores`: no row is ever
    dequantized), in float32, returned in ``dtype``. Within float32
    rounding of the float module holding ``dequantized()`` (the bound in
    `scores`).
    """
    if tape_lib.active() is not None:
      raise ValueError(f"{self.plan.name}: {lookup.TRAINING_ERROR}")
    return super().attend(query, out_sharding)

  def _attend_operands(self, query):
    (query,) = self.promote_dtype((query,), dtype=self.dtype)
    return query, self.physical_table(), scores_lib.scores

  def logical_table(self, *, replicated: bool = False):
    raise ValueError(
        f"{self.plan.name}: a quantized table has no float parameter; read "
        "dequantized() (the float32 table its lookups read), or the float module's."
    )

  def load_table(self, table) -> None:
    raise ValueError(
        f"{self.plan.name}: a quantized table can't be loaded; load the float "
        "ShardedEmbed, then embedlib.quantize it."
    )


def quantize(module, bits=fmt.INT8, scale_dtype=jnp.float16, *, skip=()):
  """Quantizes every table of ``module`` for inference.

  Args:
    module: a ``ShardedEmbed`` (a `QuantizedEmbed` is returned), or any nnx
      module holding them (concrete, or abstract from ``nnx.eval_shape``:
      its tables become ``ShapeDtypeStruct`` s, for ahead-of-time lowering) (an ``EmbeddingCollection``, a model): each
      ``ShardedEmbed`` in its graph is replaced in place by a
      `QuantizedEmbed` and ``module`` itself is returned (so the float
      tables are released, never held twice).
    bits: ``8`` / ``4`` (row-wise integers with a scale and bias per row
      block), ``"fp8"`` (float8_e4m3fn with a row scale) or ``"bf16"``.
    scale_dtype: ``jnp.float16`` or ``jnp.bfloat16``, the scales and biases.
    skip: ``plan.name`` s of tables to leave in float. A tied output
      table needs none: its ``attend`` reads the codes too.

  Returns:
    The quantized module. Training it raises; train the float one, then
    quantize it.

  >>> from flax import nnx
  >>> import numpy as np
  >>> emb = ShardedEmbed(10, 4, rngs=nnx.Rngs(0))
  >>> q = quantize(emb, bits=8)
  >>> ids = np.array([1, 9, -1])
  >>> bool(np.abs(np.asarray(q(ids) - emb(ids))).max() < 0.01), q.nbytes
  (True, 80)
  """
  fmt.check_format(bits, scale_dtype)
  one = lambda m: QuantizedEmbed(m, bits=bits, scale_dtype=scale_dtype)
  if isinstance(module, QuantizedEmbed):
    raise ValueError(f"{module.plan.name}: already quantized; quantize the float module.")
  if isinstance(module, ShardedEmbed):
    return one(module)
  done = {}  # id of a float table -> its quantized one: shared tables stay shared
  for _, parent in list(nnx.iter_graph(module)):
    for key, child in _children(parent):
      if (isinstance(child, ShardedEmbed) and not isinstance(child, QuantizedEmbed)
          and child.plan.name not in skip):
        if id(child) not in done:
          done[id(child)] = one(child)
        _assign(parent, key, done[id(child)])
  if not any(isinstance(m, ShardedEmbed) for _, m in nnx.iter_graph(module)):
    raise ValueError(
        f"quantize: {type(module).__name__} holds no ShardedEmbed; pass a ShardedEmbed, "
        "an EmbeddingCollection or a model built from them."
    )
  return module


def _children(node):
  """``(key, child)`` of a graph node's direct children (none inside a table)."""
  if isinstance(node, ShardedEmbed):
    return []
  if isinstance(node, nnx.Module):  # nnx.Dict and nnx.List too: entries are attributes
    return [(k, v) for k, v in vars(node).items() if not k.startswith("_")]
  if isinstance(node, dict):
    return list(node.items())
  if isinstance(node, list):
    return list(enumerate(node))
  return []


def _assign(parent, key, value):
  if isinstance(parent, nnx.List):
    parent[int(key)] = value
  elif isinstance(parent, nnx.Module):
    setattr(parent, key, value)
  else:
    parent[key] = value
