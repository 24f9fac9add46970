"""ShardedEmbed on 8 simulated CPU devices: plans, lookups and checks.

    python -m train.demo

Builds the seeds' awkward tables on an 8-device mesh, prints each plan, and
checks each lookup, ``attend`` and gradient against the single-device
reference. Exits non-zero if any layout disagrees.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (devices must be set before jax is imported)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import embedlib  # noqa: E402
from embedlib import axes  # noqa: E402

SCENARIOS = [
    # (title, mesh shape, axis names, vocab, width, the table's embedlib.Layout)
    ("GPT-2 vocabulary, tied output layer", (2, 4), (axes.DATA, axes.MODEL),
     50257, 768, embedlib.Layout(tied=True)),
    ("GPT-2 vocabulary, lookup only", (2, 4), (axes.DATA, axes.MODEL),
     50257, 768, embedlib.Layout()),
    ("width 100 over 8 ranks (recommender seed)", (8,), (axes.BATCH,),
     100_000, 100, embedlib.Layout()),
    ("replica axis outside the table group", (2, 4), (axes.REPLICA, axes.BATCH),
     100_000, 100, embedlib.Layout(table_axes=(axes.BATCH,))),
    ("Wide & Deep's width 1", (8,), (axes.BATCH,), 1_000_000, 1, embedlib.Layout()),
]


def _check(emb, tokens=13):
  """Max abs error of lookup, attend and gradient vs the reference."""
  table = np.asarray(jax.device_get(emb.logical_table()))
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, emb.num_embeddings, (tokens, 4)), jnp.int32)
  query = jnp.asarray(rng.normal(size=(tokens, emb.features)), jnp.float32)
  lookup = np.abs(np.asarray(emb(ids)) - table[np.asarray(ids)]).max()
  logits = np.abs(np.asarray(emb.attend(query)) - np.asarray(query) @ table.T).max()
  grad = nnx.jit(nnx.grad(lambda m: jnp.sum(m(ids) ** 2)))(emb).embedding[...]
  grad = np.asarray(jax.device_get(grad))[: emb.num_embeddings, : emb.features]
  expected = np.zeros_like(table)
  np.add.at(expected, np.asarray(ids), 2 * table[np.asarray(ids)])
  return lookup, logits, np.abs(grad - expected).max()


def main() -> int:
  print(f"jax {jax.__version__} on {len(jax.devices())} {jax.default_backend()} devices\n")
  failed = 0
  for title, shape, names, vocab, width, layout in SCENARIOS:
    mesh = jax.make_mesh(shape, names)
    emb = embedlib.ShardedEmbed(vocab, width, mesh=mesh, layout=layout, name=title,
                                rngs=nnx.Rngs(0))
    print(emb.plan)
    lookup, logits, grad = _check(emb)
    ok = lookup == 0 and logits < 1e-3 and grad < 1e-4
    failed += not ok
    print(f"  check           lookup err {lookup:.1e}, attend err {logits:.1e}, "
          f"grad err {grad:.1e}: {'OK' if ok else 'MISMATCH'}\n")
  print("all layouts match the single-device reference" if not failed
        else f"{failed} layout(s) disagree with the reference")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
