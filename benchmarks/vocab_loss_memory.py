"""Temporary bytes per device of a tied output layer's loss and gradient.

    python3 benchmarks/vocab_loss_memory.py            # vocab 262144, 8192 tokens, 8 devices
    python3 benchmarks/vocab_loss_memory.py --vocab 50257 --data 2

One step, two ways, on the same vocab-sharded ``ShardedEmbed`` (tensor
parallel: the 8 simulated CPU devices form the table group and the tokens
are replicated over it; with ``--data 2`` a 2 x 4 data x model mesh, the
tokens split over "data"): ``value_and_grad`` of the mean cross-entropy with
respect to the table and the query, from

- ``dense``: ``attend(query)`` (the logits concatenated onto every device),
  then ``optax.softmax_cross_entropy_with_integer_labels``;
- ``vocab-parallel``: ``attend(query, out_sharding=P(<data>, "model"))``
  (each device keeps its block), then ``embedlib.vocab_parallel_cross_entropy``.

Both steps are only lowered from ``jax.ShapeDtypeStruct`` inputs and
compiled, never run: nothing of the logits' size is allocated. The figure is
XLA's ``memory_analysis().temp_size_in_bytes`` of each compiled step (per
device), and the ratio vocab-parallel / dense (issue 14's target at 8
tensor-parallel devices: at most 1/4; ``tests/embed/test_vocab_loss_memory.py``
asserts it). ``--json FILE`` keeps each path's temporary MiB per device and
the ratio ``vocab_parallel_over_dense`` in ``benchmarks/timing.py``'s
record; nothing is timed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import timing
import embedlib

DATA, MODEL = "data", "model"
PATHS = ("dense", "vocab-parallel")


def _losses(spec):
  def dense(emb, query, labels):
    logits = emb.attend(query)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def vocab_parallel(emb, query, labels):
    logits = emb.attend(query, out_sharding=spec)
    return embedlib.vocab_parallel_cross_entropy(logits, labels, reduction="mean")

  return {"dense": dense, "vocab-parallel": vocab_parallel}


def compiled_steps(vocab: int, tokens: int, features: int, devices: int = 8,
                   data: int = 1, dtype=jnp.float32):
  """Each path's ``value_and_grad`` step, compiled from abstract inputs.

  Args:
    vocab, tokens, features: the logits' and the table's sizes.
    devices: the mesh's size.
    data: how many of them split the tokens (a data x model mesh); 1 for
      a tensor-parallel mesh of one "model" axis.
    dtype: the table's, the query's and so the logits' dtype.

  Returns:
    ``{path: jax.stages.Compiled}`` for ``PATHS``.
  """
  if data == 1:
    mesh = jax.make_mesh((devices,), (MODEL,), devices=jax.devices()[:devices])
  else:
    mesh = jax.make_mesh((data, devices // data), (DATA, MODEL), devices=jax.devices()[:devices])
  tokens_axis = DATA if data > 1 else None
  # Under eval_shape nothing is drawn: the parameter is a ShapeDtypeStruct.
  graphdef, state = nnx.split(nnx.eval_shape(lambda: embedlib.ShardedEmbed(
      vocab, features, mesh=mesh, layout=embedlib.Layout(sharding="vocab"), param_dtype=dtype,
      rngs=nnx.Rngs(0))))
  split = NamedSharding(mesh, P(tokens_axis))
  state = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P(MODEL, None))),
      state)
  query = jax.ShapeDtypeStruct((tokens, features), dtype, sharding=split)
  labels = jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=split)
  out = {}
  for path, loss in _losses(P(tokens_axis, MODEL)).items():
    def step(state, query, labels, loss=loss):
      def of_state(state, query):
        return loss(nnx.merge(graphdef, state), query, labels)

      return jax.value_and_grad(of_state, argnums=(0, 1))(state, query)

    out[path] = jax.jit(step).lower(state, query, labels).compile()
  return out


def temp_bytes(vocab: int, tokens: int, features: int, devices: int = 8,
               data: int = 1, dtype=jnp.float32) -> dict[str, int]:
  """``{path: temporary bytes per device}`` of each compiled step."""
  steps = compiled_steps(vocab, tokens, features, devices, data, dtype)
  return {path: c.memory_analysis().temp_size_in_bytes for path, c in steps.items()}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab", type=int, default=262_144)
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument("--features", type=int, default=1024)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--data", type=int, default=1, help="devices splitting the tokens")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  record = timing.Run("vocab_loss_memory", argv)
  dtype = jnp.dtype(args.dtype)
  measured = temp_bytes(args.vocab, args.tokens, args.features, args.devices, args.data, dtype)
  logits = args.tokens * args.vocab * dtype.itemsize
  mesh = f"{args.data} x {args.devices // args.data} data x model" if args.data > 1 else "tensor parallel"
  print(f"vocab {args.vocab}, tokens {args.tokens}, features {args.features}, "
        f"{args.devices} devices ({mesh}), {args.dtype}; all logits {logits / 2**30:.2f} GiB")
  for path in PATHS:
    print(f"  {path:15s} temp/device {measured[path]:>14,d} B = {measured[path] / 2**30:7.3f} GiB"
          f"  ({measured[path] / logits:.3f}x all logits)")
  ratio = measured["vocab-parallel"] / measured["dense"]
  model = args.devices // args.data
  print(f"  ratio vocab-parallel / dense: {ratio:.4f} (1/{model} = {1 / model:.4f}: "
        f"the logits split over {model} model ranks; issue 14's target at 8 "
        f"tensor-parallel devices: <= 0.25)")
  for path in PATHS:
    record.add_case(f"{path}: temporaries per device", measured[path] / 2**20, "MiB")
  record.ratio("vocab_parallel_over_dense", ratio)
  record.finish(args.json)
  return 0

if __name__ == "__main__":
  sys.exit(main())
