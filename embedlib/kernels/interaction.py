"""DLRM's dot interaction of separate vectors: XLA's pairs, or a C++ kernel on CPU.

`dot_pairs` gives ``<v_i, v_j>`` for every pair ``i < j`` of ``n`` vectors
``[batch, width]``. `pairs_xla` is the reference: one multiply-and-sum per
pair, which XLA fuses pair by pair, forward and backward. On CPU that is
``n (n - 1) / 2`` small passes over the batch forward (351 for DLRM's 27
vectors) and, backward, one pass per vector reading every other vector
again. The C++ kernel (``cpu/interaction.cc``) reads each example's ``n``
rows once, while they are in the core's cache, for the forward and again
for the backward, the examples split over XLA's intra-op threads
(``benchmarks/interaction.py`` times it beside XLA's pairs,
``benchmarks/train_dlrm.py`` DLRM's step with it).

The kernel runs where the interaction is differentiated (a training step:
``jax.custom_vjp``'s forward and backward rules); evaluated alone (a
prediction, an eval, the serving export) it is `pairs_xla`, so a model
gives the same bits in process as its exported program. The kernel's
results differ from `pairs_xla`'s only in the order of each sum
(``tests/kernels/test_interaction.py`` bounds the difference). It is chosen
when the program is lowered for CPU (`platforms.by_platform`), for float32
vectors, where the library loads (``cpu_library.available``:
``EMBEDLIB_CPU_KERNELS=0`` turns it off). XLA cannot split a custom call
over a mesh (it would gather every vector to each device), so on a mesh of
several devices the kernel runs inside ``shard_map`` over the mesh's data
axes, each device on its part of the batch (`batch_axes`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from embedlib import _compat, axes
from embedlib import sharding as sharding_lib
from embedlib.kernels import cpu_library, platforms
from embedlib.plan import mesh_axes


def pairs_xla(vectors) -> jax.Array:
  """``[batch, n (n - 1) / 2]``: ``<v_i, v_j>`` for ``i < j``, row-major, as XLA's fusions.

  >>> pairs_xla([jnp.ones((2, 3))] * 3).tolist()
  [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
  """
  v = list(vectors)
  return jnp.concatenate([
      jnp.sum(v[i] * v[j], axis=-1, keepdims=True)
      for i in range(len(v)) for j in range(i + 1, len(v))
  ], axis=1)


def _kernel_forward(vectors):
  n = len(vectors)
  result = jax.ShapeDtypeStruct((vectors[0].shape[0], n * (n - 1) // 2), jnp.float32)
  (out,) = cpu_library.call("embedlib_interaction", [result], *vectors)
  return out


def _kernel_backward(g, vectors):
  results = [jax.ShapeDtypeStruct(v.shape, jnp.float32) for v in vectors]
  return tuple(cpu_library.call("embedlib_interaction_backward", results, g, *vectors))


def _xla_backward(g, vectors):
  return jax.vjp(pairs_xla, vectors)[1](g)[0]


@jax.custom_vjp
def _pairs(vectors):
  # Evaluated, not differentiated (a prediction, an eval, the serving
  # export): XLA's pairs, the bits the exported program gives.
  return pairs_xla(vectors)


def _pairs_fwd(vectors):
  out = platforms.by_platform(vectors, cpu=_kernel_forward, gpu=pairs_xla, default=pairs_xla)
  return out, vectors


def _pairs_bwd(vectors, g):
  return (platforms.by_platform(g, vectors, cpu=_kernel_backward, gpu=_xla_backward,
                                default=_xla_backward),)


_pairs.defvjp(_pairs_fwd, _pairs_bwd)


def kernel_applies(vectors) -> bool:
  """Whether the C++ kernel can take ``vectors`` (the library aside): 2 or more float32 ``[batch, width]``."""
  shape = vectors[0].shape if vectors else None
  return (len(vectors) >= 2 and len(shape) == 2 and
          all(v.dtype == jnp.float32 and v.shape == shape for v in vectors))


def batch_axes(mesh) -> tuple[str, ...] | None:
  """The Auto data axes of ``mesh`` the batch is split over (``axes.DATA_AXIS_NAMES``).

  ``()`` for one device; None where the kernel can't be placed: a mesh of
  several devices with no data axis, or with an Explicit one (the batch's
  split is then part of its type, which ``shard_map`` would have to match).
  """
  if mesh is None or mesh.size == 1:
    return ()
  names = axes.named_data_axes(mesh.axis_names)
  if not names or sharding_lib.is_explicit(mesh, names):
    return None
  return names


def dot_pairs(vectors, *, mesh=None) -> jax.Array:
  """`pairs_xla`'s result; differentiated, through the C++ kernel where it applies (module docstring).

  Args:
    vectors: a sequence of ``n >= 2`` arrays ``[batch, width]``.
    mesh: the mesh whose data axes split the batch (``batch_axes``), or
      None: the one set with ``jax.set_mesh``, else one device. On several
      devices each runs the kernel on its part of the batch
      (``shard_map``), the batch padded with zero rows to a multiple of
      the data shards.

  Returns:
    ``[batch, n (n - 1) / 2]``, pairs ``(i, j)``, ``i < j``, in row-major order.

  >>> dot_pairs([jnp.ones((2, 3))] * 3).shape
  (2, 3)
  """
  vectors = tuple(vectors)
  mesh = sharding_lib.mesh_or_current(mesh)
  names = batch_axes(mesh)
  if names is None or not kernel_applies(vectors) or not cpu_library.available():
    return pairs_xla(vectors)
  if not names:
    return _pairs(vectors)
  batch = vectors[0].shape[0]
  shards = mesh_axes.axes_size(dict(mesh.shape), names)
  padded = [sharding_lib.pad_tokens(v, shards, 0.0) for v in vectors]
  spec = P(names)
  with sharding_lib.no_context_mesh():
    out = _compat.shard_map(lambda *v: _pairs(v), mesh=mesh, in_specs=(spec,) * len(padded),
                            out_specs=spec)(*padded)
  return out[:batch]
