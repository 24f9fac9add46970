"""A collection's outputs and gradients beside the reference's, each side one jit.

The collection tests (test_collection, test_placement, test_nodes) check a
module's forward and backward against ``reference.collection`` on its
logical tables. The loss weighs every output by a fixed random cotangent,
so each table's gradient is that of a sum over every output element. The
reference runs under one jit too (op by op it would compile a small
program per primitive, more than the sharded module's one), compiled once
per feature set and inputs: the cases of one test differ in mesh and layout
only, and the logical tables and cotangents are its arguments.
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.collection import reference


def _digest(arrays) -> str:
  """A key for ``{name: array or (values, lengths)}`` of numpy inputs."""
  h = hashlib.sha1()
  for name in sorted(arrays):
    for a in arrays[name] if isinstance(arrays[name], tuple) else (arrays[name],):
      a = np.asarray(a)
      h.update(f"{name}{a.shape}{a.dtype}".encode())
      h.update(a.tobytes())
  return h.hexdigest()


# {(features, inputs' digest, weights' digest): (outputs, value_and_grad)}
_PROGRAMS = {}


def _programs(features, inputs, weights):
  """The reference's outputs, and its loss's value and table gradients, as compiled functions.

  One pair per feature set and inputs: the collection tests check one set
  of inputs on several meshes, and the logical tables and cotangents are
  arguments, so each mesh's case reuses the programs.
  """
  key = (tuple(features), _digest(inputs), _digest(weights))
  if key not in _PROGRAMS:
    ref = lambda t: reference.collection(t, features, inputs, weights)

    def loss_and_out(tables, cot):
      out = ref(tables)
      return sum(jnp.sum(out[k] * cot[k]) for k in cot), out

    _PROGRAMS[key] = jax.jit(ref), jax.jit(jax.value_and_grad(loss_and_out, has_aux=True))
  return _PROGRAMS[key]


def reference_outputs(tables, features, inputs, weights):
  """``reference.collection`` on the logical ``tables``, as one program."""
  return _programs(features, inputs, weights)[0](tables)


def outputs_and_gradients(module, call, tables, features, inputs, weights, *, seed):
  """Returns ``(got, grads, want, want_grads)``.

  Args:
    module: the collection (or a module holding collections).
    call: ``module -> {feature: output}``, the module applied to the test's
      inputs.
    tables: ``{name: [rows, cols]}``, the logical tables.
    features, inputs, weights: the reference's arguments (numpy inputs).
    seed: the cotangents' random seed.

  Returns:
    The module's outputs and its parameters' gradients (an ``nnx.State``),
    and the reference's outputs and ``{table: gradient}``.
  """
  reference_fn, reference_grad = _programs(features, inputs, weights)
  shapes = jax.eval_shape(reference_fn, tables)
  rng = np.random.default_rng(seed)
  cot = {f.name: jnp.asarray(rng.normal(size=shapes[f.name].shape), jnp.float32)
         for f in features}
  loss = lambda out: sum(jnp.sum(out[k] * cot[k]) for k in cot)

  graphdef, state = nnx.split(module)
  params = nnx.state(module, nnx.Param)
  module_fn = lambda p: (lambda out: (loss(out), out))(
      call(nnx.merge(graphdef, nnx.merge_state(state, p))))
  (_, got), grads = jax.jit(jax.value_and_grad(module_fn, has_aux=True))(params)
  (_, want), want_grads = reference_grad(tables, cot)
  return got, grads, want, want_grads
