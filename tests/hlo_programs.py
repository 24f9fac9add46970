"""The compiled programs of every layout's lookup, gradient and sparse step, as text.

A refactor that should change no program is checked with it: dump the
programs before, dump them after, compare. Each program is compiled on 8
simulated CPU devices with the suite's flags (``tests/xla_env.py``) and
written as its optimized HLO with the metadata (source lines, op names)
stripped, one file per program::

    python3 -m tests.hlo_programs dump DIR          # every program into DIR
    python3 -m tests.hlo_programs compare OLD NEW   # which differ (exit 1 if any)

Programs: for each layout of ``ShardedEmbed`` (replicated, vocab, vocab
with token-sharded ids, hidden, routed, grid), a dynamic table, a
collection (table-wise and table-row-wise stacks, a routed table with
dedup, a replicated one and a dynamic one) and a quantized table: the
lookup (rows and pooled bags), the gradient of a loss on it, the sparse
step (row gradients and a ``RowWiseAdagrad`` update), and the pipelined
step (the next batch distributed while this one reads the distribution
made a step ahead, as ``training.pipeline`` runs it; with early fetch too
for the vocab and routed tables and the collection). A quantized table has
lookups only.

The modules are built with the spellings of the base commit this script was
written on; a later spelling must build the same module.
"""

from __future__ import annotations

import os
import re
import sys

if __name__ == "__main__":
  from tests import xla_env  # plain Python: jax is not imported yet

  os.environ["XLA_FLAGS"] = xla_env.flags(8)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import embedlib  # noqa: E402
from embedlib import dynamic, lookahead, optim  # noqa: E402
from embedlib.collection import DynamicSpec, FeatureSpec, TableSpec  # noqa: E402

BATCH = 16
_METADATA = re.compile(r", metadata=\{[^{}]*\}")
#: The source-location tables XLA writes after the module header.
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def strip(hlo: str) -> str:
  """The HLO text without metadata (op names, source files and lines, stack frames)."""
  blocks = [b for b in hlo.split("\n\n") if not b.lstrip("\n").startswith(_TABLES)]
  text = _METADATA.sub("", "\n\n".join(blocks))
  return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def _mesh():
  return jax.make_mesh((2, 4), ("data", "model"))


def _rng(seed):
  return np.random.default_rng(seed)


def _ids(rows, shape, seed):
  return jnp.asarray(_rng(seed).integers(-1, rows + 1, shape), jnp.int32)


# -- the modules -------------------------------------------------------------

TABLE_LAYOUTS = {
    "replicated": dict(sharding="replicated"),
    "vocab": dict(sharding="vocab", table_axes=("model",), data_axes=("data",)),
    "vocab_tokens": dict(sharding="vocab", table_axes=("model",), data_axes=("data", "model")),
    "hidden": dict(sharding="hidden", table_axes=("model",), data_axes=("data",)),
    "routed": dict(sharding="routed", table_axes=("data", "model"),
                   data_axes=("data", "model"), route_capacity=8),
    "grid": dict(sharding="grid", table_axes=("model",), column_axes=("data",),
                 data_axes=("data", "model")),
}


def table(layout):
  return embedlib.ShardedEmbed(1000, 12, mesh=_mesh(), rngs=nnx.Rngs(0),
                               **TABLE_LAYOUTS[layout])


def table_inputs(seed):
  return {"ids": _ids(1000, (BATCH, 3), seed), "bags": _ids(1000, (BATCH, 4), seed + 1),
          "weights": jnp.asarray(_rng(seed).uniform(0.5, 2, (BATCH, 4)), jnp.float32)}


def table_lookup(m, x):
  return m(x["ids"]), m.bag(x["bags"], x["weights"], combiner="mean")


def dynamic_table():
  return embedlib.DynamicEmbed(1024, 8, mesh=_mesh(), sharding="vocab", table_axes=("model",),
                               data_axes=("data",), bucket_size=64, rngs=nnx.Rngs(0))


def dynamic_inputs(seed):
  ids = _rng(seed).integers(0, 5000, (BATCH, 3)).astype(np.uint32)
  ids[0, 0] = 0xFFFFFFFF  # padding
  return {"ids": jnp.asarray(ids), "bags": jnp.asarray(ids[:, :2])}


def dynamic_lookup(m, x):
  return m(x["ids"]), m.bag(x["bags"], combiner="sum")


COLLECTION_TABLES = (
    TableSpec("big", 3000, 8, sharding="routed"),
    TableSpec("mid", 300, 8, sharding="table_row"),
    TableSpec("a", 50, 8, sharding="table"),
    TableSpec("c", 30, 4, sharding="table"),
    TableSpec("small", 20, 8),
    TableSpec("user", 512, 8, dynamic=DynamicSpec(bucket_size=64)),
)
COLLECTION_FEATURES = (
    FeatureSpec("f_big", "big", combiner="mean"),
    FeatureSpec("f_big_seq", "big", combiner=None),
    FeatureSpec("f_mid", "mid", combiner=None),
    FeatureSpec("f_a", "a", max_ids_per_sample=1),
    FeatureSpec("f_c", "c"),
    FeatureSpec("f_small", "small"),
    FeatureSpec("f_user", "user", combiner="sum"),
    FeatureSpec("f_user_seq", "user", combiner=None),
)


def collection():
  return embedlib.EmbeddingCollection(
      COLLECTION_TABLES, COLLECTION_FEATURES, mesh=jax.make_mesh((8,), ("batch",)),
      table_batched=True, devices_per_host=4, batch_size=BATCH, num_unique={"stack_8": 24},
      rngs=nnx.Rngs(0))


def collection_inputs(seed):
  rows = {t.name: t.num_embeddings for t in COLLECTION_TABLES}
  shape = {"f_big": (BATCH, 3), "f_big_seq": (BATCH, 2), "f_mid": (BATCH, 2), "f_a": (BATCH,),
           "f_c": (BATCH, 2), "f_small": (BATCH, 2), "f_user": (BATCH, 2),
           "f_user_seq": (BATCH, 2)}
  ids = {f.name: _ids(rows[f.table], shape[f.name], seed + i)
         for i, f in enumerate(COLLECTION_FEATURES)}
  for name in ("f_user", "f_user_seq"):
    ids[name] = jnp.abs(ids[name]).astype(jnp.uint32) * 7919
  return {"ids": ids, "weights": {"f_big": jnp.asarray(
      _rng(seed).uniform(0.5, 2, shape["f_big"]), jnp.float32)}}


def collection_lookup(m, x):
  return m(x["ids"], x["weights"])


#: The cases whose pipelined step also fetches rows early (routed and vocab tables).
EARLY_FETCH = ("table_vocab", "table_vocab_tokens", "table_routed", "collection")
CASES = {f"table_{k}": (lambda k=k: table(k), table_inputs, table_lookup) for k in TABLE_LAYOUTS}
CASES["dynamic"] = (dynamic_table, dynamic_inputs, dynamic_lookup)
CASES["collection"] = (collection, collection_inputs, collection_lookup)


# -- the programs -------------------------------------------------------------

def _loss(lookup):
  def loss(m, x):
    out = jax.tree.leaves(lookup(m, x))
    return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in out)
  return loss


def _compiled(fn, modules, *args) -> str:
  """``fn(*modules, *args)``'s compiled HLO, the modules' state in and out."""
  graphdef, state = nnx.split(modules)

  def pure(state, *args):
    mods = nnx.merge(graphdef, state)
    out = fn(*mods, *args)
    return out, nnx.state(mods)

  return strip(jax.jit(pure).lower(state, *args).compile().as_text())


def programs(name):
  """``{program: hlo}`` of one case."""
  make, inputs, lookup = CASES[name]
  loss = _loss(lookup)
  x, nxt = inputs(1), inputs(2)
  out = {}
  m = make()
  out["lookup"] = _compiled(lookup, (m,), x)
  m = make()
  out["grad"] = _compiled(lambda m, x: nnx.grad(loss)(m, x), (m,), x)
  m = make()
  opt = optim.SparseAwareOptimizer(m, None, optim.RowWiseAdagrad(learning_rate=0.1))

  def step(m, opt, x):
    value, grads = optim.value_and_grad(loss)(m, x)
    dynamic.reset_slots(opt, m)
    opt.update(m, grads)
    return value

  out["step"] = _compiled(step, (m, opt), x)

  def collect(m, x, previous=None, early_fetch=0.0):
    copy = nnx.merge(*nnx.split(m))
    with lookahead.collecting(early_fetch, previous) as dists:
      loss(copy, x)
    return dists()

  m = make()
  out["distribute"] = _compiled(collect, (m,), x)
  m = make()
  opt = optim.SparseAwareOptimizer(m, None, optim.RowWiseAdagrad(learning_rate=0.1))
  dist = nnx.jit(collect)(m, x)

  def pipelined(m, opt, x, dist, nxt):
    following = collect(m, nxt, previous=dist)
    with lookahead.using(dist):
      value, grads = optim.value_and_grad(loss)(m, x)
    dynamic.reset_slots(opt, m)
    opt.update(m, grads)
    return value, following

  out["pipelined_step"] = _compiled(pipelined, (m, opt), x, dist, nxt)
  if name in EARLY_FETCH:  # rows fetched a step ahead too, corrected after the update
    m = make()
    opt = optim.SparseAwareOptimizer(m, None, optim.RowWiseAdagrad(learning_rate=0.1))
    dist = nnx.jit(lambda m, x: collect(m, x, early_fetch=0.5))(m, x)

    def early(m, opt, x, dist, nxt):
      following = collect(m, nxt, previous=dist, early_fetch=0.5)
      with lookahead.using(dist):
        value, grads = optim.value_and_grad(loss)(m, x)
      dynamic.reset_slots(opt, m)
      opt.update(m, grads)
      return value, following

    out["pipelined_step_early_fetch"] = _compiled(early, (m, opt), x, dist, nxt)
  return out


def quantized_programs():
  out = {}
  for layout in TABLE_LAYOUTS:
    q = embedlib.quantize(table(layout), bits=8)
    out[f"quantized_{layout}/lookup"] = _compiled(table_lookup, (q,), table_inputs(1))
  return out


def all_programs():
  out = {}
  for name in CASES:
    out.update({f"{name}/{k}": v for k, v in programs(name).items()})
  out.update(quantized_programs())
  return out


def dump(directory):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    found = all_programs()
  for key, text in found.items():
    path = os.path.join(directory, key.replace("/", "__") + ".hlo")
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
      f.write(text)
  print(f"{len(found)} programs written to {directory}")


def compare(old, new) -> int:
  names = sorted(set(os.listdir(old)) | set(os.listdir(new)))
  differ = []
  for n in names:
    a, b = (os.path.join(d, n) for d in (old, new))
    if not (os.path.exists(a) and os.path.exists(b)):
      differ.append(f"{n}: only in {old if os.path.exists(a) else new}")
    elif open(a).read() != open(b).read():
      differ.append(f"{n}: differs")
  print(f"{len(names)} programs compared, {len(names) - len(differ)} equal")
  for d in differ:
    print("  " + d)
  return 1 if differ else 0


if __name__ == "__main__":
  verb, *paths = sys.argv[1:]
  if verb == "dump":
    dump(*paths)
  elif verb == "compare":
    sys.exit(compare(*paths))
  else:
    sys.exit(f"usage: python3 -m tests.hlo_programs dump DIR | compare OLD NEW (got {verb!r})")
