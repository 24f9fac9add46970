"""The oracle of a quantized module: its float twin holding the dequantized tables.

A quantized lookup is the float lookup of ``dequantize(table)`` with the same
arithmetic (`embedlib.quant.lookup`), so the twin -- the float module whose
physical tables are set to the dequantized ones, in the same layouts, with
the same kernels -- gives the same bits, every layout and kernel alike.
"""

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import embedlib
from embedlib import param as param_lib
from embedlib.quant import format as fmt


def quantized_and_twin(model, bits, scale_dtype=None):
  """``(quantized model, float twin)``; ``model`` is left float."""
  twin = nnx.clone(model)
  kw = {} if scale_dtype is None else {"scale_dtype": scale_dtype}
  quantized = embedlib.quantize(nnx.clone(model), bits, **kw)
  floats = {m.plan.name: m for _, m in nnx.iter_graph(twin) if isinstance(m, embedlib.ShardedEmbed)}
  for _, q in nnx.iter_graph(quantized):
    if isinstance(q, embedlib.QuantizedEmbed):
      f = floats[q.plan.name]
      table = fmt.dequantize(q.physical_table())
      if f.mesh is not None:
        table = jax.device_put(table, NamedSharding(f.mesh, P(*f.plan.table_spec)))
      param_lib.set_physical(f.embedding, table.astype(f.param_dtype))
  return quantized, twin


def attend_bound(q, query):
  """The bound on ``|q.attend(query) - twin.attend(query)|`` per logit (`embedlib.quant.scores`).

  ``2 (F + 4) 2**-24 |q| . (|x'| + 2 |b|)``: ``x'`` the dequantized rows,
  ``b`` each row block's bias, ``F`` the columns. ``query``: ``[T, F]``.
  """
  table = jax.device_get(q.physical_table())
  deq = np.abs(np.asarray(jax.device_get(q.dequantized()), np.float32))
  if table.scale_bias is None:
    bias = np.zeros_like(deq)
  else:
    per_block = np.abs(np.asarray(table.scale_bias[..., 1], np.float32))
    bias = np.repeat(per_block, table.block_width, axis=1)[:q.num_embeddings, :q.features]
  query = np.abs(np.asarray(jax.device_get(query), np.float32))
  return 2 * (q.features + 4) * 2.0 ** -24 * (query @ (deq + 2 * bias).T) + 1e-30
