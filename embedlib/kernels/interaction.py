"""DLRM's dot interaction of separate vectors: XLA's pairs, or a C++ kernel on CPU.

`dot_pairs` gives ``<v_i, v_j>`` for every pair ``i < j`` of ``n`` vectors
``[batch, width]``. `pairs_xla` is the reference: one multiply-and-sum per
pair, which XLA fuses pair by pair, forward and backward. On CPU that is
``n (n - 1) / 2`` small passes over the batch forward (351 for DLRM's 27
vectors) and, backward, one pass per vector reading every other vector
again. The C++ kernel (``cpu/interaction.cc``) reads each example's ``n``
rows once, while they are in the core's cache, for the forward and again
for the backward, the examples split over XLA's intra-op threads
(``benchmarks/train_dlrm.py`` times DLRM's step with it).

The kernel runs where the interaction is differentiated (a training step:
``jax.custom_vjp``'s forward and backward rules); evaluated alone (a
prediction, an eval, the serving export) it is `pairs_xla`, so a model
gives the same bits in process as its exported program. The kernel's
results differ from `pairs_xla`'s only in the order of each sum
(``tests/kernels/test_interaction.py`` bounds the difference). It is chosen
when the program is lowered for CPU (`platforms.by_platform`), for float32
vectors, where the library loads (``cpu_library.available``:
``EMBEDLIB_CPU_KERNELS=0`` turns it off), and where the caller says the
vectors lie on one device (``cpu_kernel``): XLA cannot split a custom call
over a mesh, and would gather every vector to each device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from embedlib.kernels import cpu_library, platforms


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


def dot_pairs(vectors, *, cpu_kernel: bool = True) -> jax.Array:
  """`pairs_xla`'s result; differentiated, through the C++ kernel where it applies (module docstring).

  Args:
    vectors: a sequence of ``n >= 2`` arrays ``[batch, width]``.
    cpu_kernel: whether the vectors lie on one device, so that a CPU
      lowering may run the C++ kernel; False keeps XLA's pairs everywhere.

  Returns:
    ``[batch, n (n - 1) / 2]``, pairs ``(i, j)``, ``i < j``, in row-major order.

  >>> dot_pairs([jnp.ones((2, 3))] * 3).shape
  (2, 3)
  """
  vectors = tuple(vectors)
  if cpu_kernel and kernel_applies(vectors) and cpu_library.available():
    return _pairs(vectors)
  return pairs_xla(vectors)
