"""Per-platform code in one program: the kernel is chosen when it is lowered, not traced.

A jitted lookup may be lowered for a platform other than the one that traced
it (``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` on a CPU
machine) or for several at once (``jax.export(..., platforms=("cpu",
"cuda"))``). So the lookups never read the platform while tracing; they
stage every platform's choice with ``lax.platform_dependent`` (`by_platform`)
and the lowering keeps the branch of each platform it lowers for.

One gap needs filling: in a multi-platform lowering jax lowers each kept
branch for *every* platform of the module, and a compiled ``pallas_call``
refuses to lower for the CPU ("Only interpret mode is supported"). `on_gpu`
wraps such a call in a primitive whose CUDA lowering is the call itself
(lowered in a context naming CUDA alone) and whose lowering for any other
platform is a placeholder of the right type: a branch that
``lax.platform_dependent`` never runs there. Lowered for one platform that
is not CUDA (which ``by_platform`` never does), it raises.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import batching
from jax.interpreters import mlir

#: Platforms whose branch holds the compiled GPU kernels.
GPU = "cuda"

class _OnGpu(jex_core.Primitive):
  # jax >= 0.12 calls a primitive "high" when a jaxpr parameter is (a Mosaic
  # GPU kernel's is) and wants it rewritten first; this one is only lowered,
  # by tracing its jaxpr again, which does that rewriting itself.
  def is_high(self, *avals, **params) -> bool:
    return False


_on_gpu_p = _OnGpu("embedlib_on_gpu")
_on_gpu_p.multiple_results = True


def _ordered_effects():
  from jax._src import callback  # the effect of ordered host callbacks

  return {callback._OrderedIOEffect}


@_on_gpu_p.def_effectful_abstract_eval
def _abstract_eval(*args, jaxpr, name, ordered):
  del args, name
  return jaxpr.out_avals, _ordered_effects() if ordered else set()


def _run(*args, jaxpr, name, ordered):
  del name, ordered
  return jex_core.jaxpr_as_fun(jaxpr)(*args)


def _placeholder(ctx, *args, jaxpr, name, ordered):
  if len(ctx.module_context.platforms) < 2:
    raise ValueError(
        f"{name}: a compiled GPU kernel is being lowered for "
        f"{ctx.module_context.platforms[0]!r}; it runs on CUDA only. Use "
        "kernel='auto' (or interpret=None) so that each platform gets its own kernel."
    )
  # Never run: the enclosing lax.platform_dependent picks another branch on
  # this platform. Zeros of the right types keep the module well formed.
  return mlir.lower_fun(
      lambda *_: [jnp.zeros(a.shape, a.dtype) for a in jaxpr.out_avals], multiple_results=True
  )(ctx, *args)


def _batch(args, dims, **params):
  # One call per element of the batch (lax.map): the wrapped kernel is
  # traced for unbatched shapes, and not every Pallas GPU kernel can be
  # vmapped. ``lax.platform_dependent`` traces every platform's branch, so
  # a vmapped lookup reaches here on any machine.
  mapped = [i for i, d in enumerate(dims) if d is not None]  # None: not batched
  xs = [jnp.moveaxis(args[i], dims[i], 0) for i in mapped]

  def one(x):
    full = list(args)
    for i, value in zip(mapped, x):
      full[i] = value
    return _on_gpu_p.bind(*full, **params)

  outs = lax.map(one, xs)
  return outs, [0] * len(outs)


_on_gpu_p.def_impl(_run)
batching.primitive_batchers[_on_gpu_p] = _batch
mlir.register_lowering(_on_gpu_p, mlir.lower_fun(_run, multiple_results=True), platform=GPU)
mlir.register_lowering(_on_gpu_p, _placeholder)


def on_gpu(fn: Callable, *args, name: str = "kernel", ordered: bool = False):
  """``fn(*args)``, lowered for CUDA only (a placeholder on other platforms of the module).

  Args:
    fn: a function of pytrees of arrays returning a pytree of arrays (a
      compiled Pallas GPU kernel).
    *args: its arguments.
    name: named in the error raised when lowered for a single non-CUDA platform.
    ordered: declare (and pass through) the ordered effect of host
      callbacks: for a call in a ``platform_dependent`` beside Mosaic GPU's
      interpreter.

  Returns:
    What ``fn`` returns.
  """
  leaves, in_tree = jax.tree.flatten(args)
  flat_fn = lambda *leaves: fn(*jax.tree.unflatten(in_tree, leaves))
  jaxpr, shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
  out = _on_gpu_p.bind(*leaves, jaxpr=jaxpr, name=name, ordered=ordered)
  return jax.tree.unflatten(jax.tree.structure(shapes), out)


def by_platform(*args, cpu: Callable, gpu: Callable, default: Callable):
  """``lax.platform_dependent`` over CPU, CUDA and the rest, without it when they agree.

  Every branch is traced (inside ``jit``) wherever the program is lowered,
  so a branch that is the same function as another is staged once: pass the
  same object, not two functions that do the same.

  Args:
    *args: arrays passed to the branch.
    cpu: the branch lowered for CPU.
    gpu: the branch lowered for CUDA.
    default: the branch lowered for any other platform (ROCm, TPU).

  Returns:
    The branch's result, chosen per lowering platform.

  >>> by_platform(jnp.ones(2), cpu=lambda x: x + 1, gpu=lambda x: x + 2,
  ...             default=lambda x: x).tolist()
  [2.0, 2.0]
  """
  if cpu is gpu is default:
    return cpu(*args)
  # lax.platform_dependent joins equal named branches, not one equal to default.
  if gpu is default:
    return lax.platform_dependent(*args, cpu=cpu, default=default)
  if cpu is default:
    return lax.platform_dependent(*args, cuda=gpu, default=default)
  return lax.platform_dependent(*args, cpu=cpu, cuda=gpu, default=default)
