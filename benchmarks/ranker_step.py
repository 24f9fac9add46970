"""The transformer ranker's train step: embedlib against nnx.Embed + a dense optax optimizer.

    python3 benchmarks/ranker_step.py              # item vocab 1M and 10M, on 1 and 8 devices
    python3 benchmarks/ranker_step.py --quick      # small vocabularies, a smoke run
    python3 benchmarks/ranker_step.py --check      # first: both steps give the same loss
    python3 benchmarks/ranker_step.py --json run.json  # also the run's record (timing.Run)

The model is ``configs/ranker.py``'s (width 32, 2 layers, 32 history events,
16 candidates, 5 actions, item rows of 32 floats), on a batch of 256 planted
requests, with the item vocabulary set to each size. Two versions of it:

- embedlib: the item and author tables are ``ShardedEmbed`` (split over the
  devices), the user table a ``MultiHashEmbed``; the tables train with
  ``RowWiseAdagrad`` through ``embedlib.optim.value_and_grad`` (only the
  rows the batch looked up), the rest with Adam;
- nnx.Embed: the same modules with ``nnx.Embed`` tables (the item table
  split by rows over the devices, through its ``out_sharding`` metadata, as
  a Flax user would), everything trained with ``optax.adam`` through
  ``nnx.value_and_grad``: a table-sized gradient and two table-sized moments.

Both are one jitted step with the state donated, on a mesh of 1 and of 8
devices (simulated on CPU: ``--xla_force_host_platform_device_count=8`` is
set unless ``XLA_FLAGS`` names a device count). Timing: rounds in shuffled
order, each case one untimed step before its timed one
(``sparse_step.settled_rounds``); prints min / median / max ms per case,
the ratio of medians (nnx.Embed / embedlib), and per device, from XLA's
memory analysis of each compiled step: its arguments (the state and the
batch), temporaries, and peak (arguments + outputs not aliased to a donated
input + temporaries). ``--json FILE`` keeps the run's record
(``benchmarks/timing.py``): the cases and, per vocabulary and device count,
the named ratio ``vs_nnx_embed_<vocab>_<devices>dev`` (the dense step's
median over embedlib's), beside the machine's state. Never asserts a time.
"""

import argparse
import os
import statistics
import sys

if "device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from flax.nnx.nn.linear import default_embed_init  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from configs import ranker as ranker_config  # noqa: E402
from embedlib import Layout, ShardedEmbed, optim  # noqa: E402
from embedlib import data as data_lib  # noqa: E402
from embedlib.models import MultiHashEmbed, RankerTrunk, TransformerRanker, hashers  # noqa: E402
from embedlib.training.tasks import RankingTask  # noqa: E402
from sparse_step import Stepper, settled_rounds  # noqa: E402
import timing  # noqa: E402
from timing import print_table  # noqa: E402

EMBEDLIB, DENSE = "embedlib, row-wise AdaGrad", "nnx.Embed, dense optax.adam"
AXIS = "batch"
MiB = 1 << 20


class DenseMultiHash(nnx.Module):
  """``MultiHashEmbed`` with an ``nnx.Embed`` table (row 0 is an ordinary row)."""

  def __init__(self, hasher, features, out_features, rngs):
    self.hasher = hasher
    self.table = nnx.Embed(hasher.num_buckets, features, rngs=rngs)
    self.project = nnx.Linear(hasher.num_hashes * features, out_features, use_bias=False,
                              rngs=rngs)
    self.out_features = out_features

  def __call__(self, rows):
    v = self.table(rows)
    return self.project(v.reshape(rows.shape[:-1] + (-1,)))


def build(kind, cfg, spec, mesh):
  """The ranker with embedlib tables (``EMBEDLIB``) or ``nnx.Embed`` ones (``DENSE``)."""
  rngs = nnx.Rngs(0)
  m = cfg.model
  hasher = hashers(m)["user"]
  if kind == EMBEDLIB:
    tables = dict(mesh=mesh, layout=Layout(kernel="auto", replicate_below_bytes=0))
    items = ShardedEmbed(spec.num_items, m.item_features, name="item", rngs=rngs, **tables)
    authors = ShardedEmbed(spec.num_authors, m.author_features, name="author", rngs=rngs,
                           **tables)
    user = MultiHashEmbed(hasher, m.user_hash.features, out_features=m.width, name="user",
                          rngs=rngs, **tables)
  else:
    split = nnx.with_partitioning(default_embed_init, (AXIS, None), mesh=mesh)
    items = nnx.Embed(spec.num_items, m.item_features, embedding_init=split, rngs=rngs)
    authors = nnx.Embed(spec.num_authors, m.author_features, rngs=rngs)
    user = DenseMultiHash(hasher, m.user_hash.features, m.width, rngs)
  trunk = RankerTrunk(items=items, authors=authors, user=user, num_actions=spec.num_actions,
                      history_len=spec.history_len, width=m.width, num_layers=m.num_layers,
                      num_heads=m.num_heads, mlp_ratio=m.mlp_ratio,
                      action_features=m.action_features, rngs=rngs)
  return TransformerRanker(trunk, rngs=rngs)


def place(tree, mesh):
  """Each array onto ``mesh``: as its ``out_sharding`` metadata says, else replicated."""
  def one(x):
    metadata = x.get_metadata() if isinstance(x, nnx.Variable) else {}
    spec = metadata.get("out_sharding") or metadata.get("sharding")
    value = x[...] if isinstance(x, nnx.Variable) else x
    sharding = NamedSharding(mesh, P(*spec) if spec else P())
    return jax.device_put(value, sharding)
  state = nnx.state(tree)
  placed = jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  nnx.update(tree, placed)


def build_step(kind, cfg, spec, mesh, task):
  """``(jitted step(state, batch) -> (loss, state)`` with the state donated, state)."""
  model = build(kind, cfg, spec, mesh)
  place(model, mesh)  # before the optimizer: its moments take the parameters' layout
  if kind == EMBEDLIB:
    opt = optim.SparseAwareOptimizer(model, optax.adam(1e-3), optim.RowWiseAdagrad(0.1))
    grad = optim.value_and_grad
  else:
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    grad = nnx.value_and_grad
  place(opt, mesh)
  graphdef, state = nnx.split((model, opt))

  def step(state, batch):
    model, opt = nnx.merge(graphdef, state)
    loss, grads = grad(task.loss)(model, batch)
    opt.update(model, grads)
    return loss, nnx.state((model, opt))

  return jax.jit(step, donate_argnums=0), state


def setting(vocab, quick):
  cfg = ranker_config.get_config("smoke" if quick else None)
  with cfg.unlocked():
    cfg.data.num_items = vocab
  spec = data_lib.SequenceSpec(vocab, cfg.data.num_authors, cfg.data.history_len,
                               cfg.data.num_candidates, tuple(cfg.data.actions))
  task = RankingTask(spec=spec, user_hasher=hashers(cfg.model)["user"],
                     loss_weights=(1.0,) * spec.num_actions,
                     ndcg_weights=(1.0,) * spec.num_actions, ndcg_k=8)
  source = data_lib.PlantedRankingSource(spec, batch_size=cfg.batch_size,
                                         num_users=cfg.data.num_users,
                                         num_topics=cfg.data.num_topics)
  return cfg, spec, task, task.featurize(source.batch(0))


def mesh_of(n):
  return jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def check(vocab=5000) -> bool:
  """Both versions, from the same tables, give the same first loss on 8 devices (1e-5)."""
  cfg, spec, task, batch = setting(vocab, quick=True)
  mesh = mesh_of(min(8, jax.device_count()))
  losses = []
  for kind in (DENSE, EMBEDLIB):
    step, state = build_step(kind, cfg, spec, mesh, task)
    losses.append(float(step(state, data_lib.to_global_batch(batch, mesh))[0]))
  ok = bool(np.isclose(losses[0], losses[1], rtol=1e-5))
  print(f"check: first loss, {DENSE} {losses[0]:.6f}, {EMBEDLIB} {losses[1]:.6f}: "
        f"{'equal' if ok else 'DIFFERENT'}")
  return ok


def run(vocab, devices, repeats, quick, record):
  cfg, spec, task, host_batch = setting(vocab, quick)
  mesh = mesh_of(devices)
  batch = data_lib.to_global_batch(host_batch, mesh)
  steppers, memory = {}, {}
  for kind in (EMBEDLIB, DENSE):
    step, state = build_step(kind, cfg, spec, mesh, task)
    compiled = step.lower(state, batch).compile()
    memory[kind] = compiled.memory_analysis()
    steppers[kind] = Stepper(compiled, state)
    jax.block_until_ready(steppers[kind](batch))
  table = vocab * cfg.model.item_features * 4
  print(f"\nitem vocab {vocab:,} ({table / MiB:,.0f} MiB of item rows), {devices} device(s), "
        f"batch {cfg.batch_size} requests")
  times = settled_rounds({k: (lambda s=s: s.timed(batch)) for k, s in steppers.items()},
                         repeats, between_rounds=record.probe)
  tag = f"{timing.size_tag(vocab, cfg.model.item_features).split('_x_')[0]}_{devices}dev"
  record.add_times(times, prefix=f"{tag}: ")
  print_table(times, EMBEDLIB, f"train step, ms ({repeats} rounds)")
  ratio = statistics.median(times[DENSE]) / statistics.median(times[EMBEDLIB])
  print(f"ratio of medians ({DENSE} / {EMBEDLIB}): {ratio:.1f}x")
  record.ratio(f"vs_nnx_embed_{tag}", ratio)
  for kind, mem in memory.items():
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes)
    print(f"  {kind:30s} per device: arguments {mem.argument_size_in_bytes / MiB:8.1f} MiB, "
          f"temporaries {mem.temp_size_in_bytes / MiB:8.1f} MiB, peak {peak / MiB:8.1f} MiB")
  for stepper in steppers.values():
    del stepper.state


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--check", action="store_true",
                      help="first check both versions give the same loss; exit 1 if not")
  parser.add_argument("--vocab", type=int, nargs="*", default=None)
  parser.add_argument("--devices", type=int, nargs="*", default=None)
  timing.add_json_argument(parser)
  args = parser.parse_args(argv)
  record = timing.Run("ranker_step", argv, smoke=args.quick)
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices")
  if args.check and not check():
    return 1
  vocabs = args.vocab or ([10_000, 100_000] if args.quick else [1_000_000, 10_000_000])
  devices = args.devices or [1, min(8, jax.device_count())]
  for vocab in vocabs:
    for n in devices:
      run(vocab, n, args.repeats or (2 if args.quick else 5), args.quick, record)
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
