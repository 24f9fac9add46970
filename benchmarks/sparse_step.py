"""Sparse row-wise AdaGrad train step against the dense optax step, in one run.

    python3 benchmarks/sparse_step.py            # 1M x 64 and 10M x 32 f32, 65,536 Zipf ids
    python3 benchmarks/sparse_step.py --quick    # small sizes, a smoke run
    python3 benchmarks/sparse_step.py --check    # first: the sparse step vs a dense reference
    python3 benchmarks/sparse_step.py --layouts  # the 2-D layout: 8 simulated devices
    python3 benchmarks/sparse_step.py --json run.json   # also the run's record (timing.Run)
    bash benchmarks/install_peers.sh             # first, for the PyTorch columns

One device of jax's default backend (a GPU where there is one: the lookup is
then ``kernel="auto"``'s, XLA's ``jnp.take`` since ``kernels/gpu_choice.py``),
one ``ShardedEmbed`` (no mesh), ids drawn from Zipf(1.05) and hashed over the
table. Each step is the whole train step, jitted with the state donated:
lookup, gradient, update, loss ``mean(sum(rows, -1) ** 2)``.

- sparse: ``embedlib.optim.value_and_grad`` + ``SparseAwareOptimizer`` with
  ``RowWiseAdagrad`` (row gradients, dedup, update of the touched rows); on
  CPU the update is the fused C++ call of ``embedlib/optim/fused_cpu.py``;
  on other platforms it is the sorted update of
  ``embedlib/optim/sorted_update.py`` (no colliding scatter-add);
- sparse, XLA ops: the same step with the update in ``apply.py``'s XLA ops
  (the CPU's where the fused call does not apply; GPUs' before the sorted
  update);
- sparse, sorted (CPU only): the same step with the sorted update, as every
  other platform runs it;
- dense: ``nnx.value_and_grad`` + ``nnx.Optimizer(optax.adagrad)`` (a
  table-sized gradient, every row updated), its accumulators from 0 as
  ``torch.optim.Adagrad``'s;
- PyTorch columns, for scale, when ``.peers/`` is installed (each in its own
  worker, ``benchmarks/peers/torch_sparse_step.py``, same ids and loss;
  its large blocks on 2 MiB pages, as the CPU kernels put embedlib's
  tables, ``worker_protocol.peer_env``):
  FBGEMM's fused row-wise AdaGrad (TorchRec ``FusedEmbeddingBagCollection``),
  ``nn.Embedding(sparse=True)`` + ``torch.optim.Adagrad``, and the dense
  ``nn.Embedding`` + ``Adagrad``. ``--no-peers`` leaves them out,
  ``--peer-cases fused`` runs FBGEMM's alone (the others hold about 8 GiB
  at 10M x 32, which a 24 GB machine shared with other jobs lacks). They are
  CPU workers, so they are left out on any other backend;
- the bandwidth limit (``bandwidth.py``): a jitted in-place ``x + 1`` over
  a donated float32 buffer sized so that its read and write together move
  the bytes the sparse step must touch (``bandwidth.step_bytes``: the ids,
  the looked-up rows read and written, each distinct row and its AdaGrad
  slot read and written; not the row gradient), and one over a 1 GiB
  buffer (128 MiB with ``--quick``), past the caches, for the DRAM's rate. After the table: those
  bytes by part, each copy's GB/s, the step's effective GB/s, and its
  distance from the limit, step / copy of its bytes (medians).

``--layouts`` runs another part instead, on 8 simulated CPU devices laid
out as LLM training lays them out (fsdp=2 x tensor=4, ids split over
'fsdp'): the sparse step (fused CPU update) of a vocab and a hidden table
over 'tensor' beside a grid (rows over 'tensor', columns over 'fsdp', what
``P('tensor', 'fsdp')`` asks for): min / median / max ms and the ratio to
vocab, each table's bytes per device, and the bytes one device receives
per step, read from the compiled HLO's collectives. The simulated devices
share this machine's cores: the times show each layout's overheads, not a
speed-up.

``--check`` first runs a few sparse steps on a small table against a dense
numpy reference of row-wise AdaGrad on the same ids (touched rows and
accumulators within float32 rounding, untouched ones exact; on CPU for both
updates) and stops with exit status 1 if they differ: the first thing to
run on a new GPU.

Timing: in each round the cases run in a shuffled order, and each runs one
untimed step before its timed one. The untimed step matters: a step leaves
work behind it (the dense step frees its table-sized temporaries after its
results are ready), which would otherwise be charged to whichever case runs
next (a pause after the dense step removes that cost too, so it is not the
next case's own). A JAX step is timed until its loss and whole new state
are ready. One timed sample is ``--inner`` consecutive steps, reported per
step, the untimed call before it as many: on a GPU 20 (dispatched without
waiting, so a sub-millisecond step is not timed as Python's dispatch), on
CPU 8, the PyTorch workers' too. Training runs its steps back to back, and
a CPU step timed alone, after the other cases or a worker's turn left this
process idle, pays the machine's wake-up instead: on the 2-core VMs a
jitted copy of the step's bytes took 1.6 ms timed alone and 0.6 ms back to
back (``benchmarks/README.md``, "One step timed alone"), which made the
ratios to the copy mostly that wake-up's. Runs kept before 2026-12-07's
sixth session timed one step (``--inner 1`` gives that protocol).

Named ratios (printed beside the machine's state, and in ``--json``'s
record, ``benchmarks/timing.py``), by medians, ``<size>`` as ``1M_x_64``:
``vs_fbgemm_<size>`` FBGEMM fused's step time over the sparse step's (with
the peers), ``copy_distance_<size>`` the sparse step's time over the copy
of its bytes, ``dense_over_sparse_<size>`` the dense step's over the sparse
step's; on CPU, ``rows_floor_over_copy_<size>`` the time of the two passes
over the table every step makes, the gather of its ids' rows and then its
distinct rows read and written in place (``bandwidth.rows_step``: random
rows, where the copy streams), over the copy's, and
``rows_floor_distance_<size>`` the sparse step's over that;
``bare_floor_over_copy_<size>`` the same two passes in bare C++ loops
(``bandwidth.bare_floor``: no XLA, no dedup, rows in ascending order, each
round on the next batch of ids; its own process after the rounds,
``4 x --repeats`` rounds alternating with a bare copy of the step's bytes)
over that bare copy, what random rows cost against a stream on this
machine, ``bare_copy_over_copy_<size>`` the bare copy's time over the jitted
copy's (how much of the copy's time is XLA's own), and
``least_step_over_copy_<size>``, the least a step whose
model is kept apart from its lookup can take over the copy: the bare passes
plus ``bandwidth.model_bytes`` (the model's read of the rows, their
gradient written and read back) streamed at the bare copy's own rate, over
the bare copy (a floor: no dedup, no rule, no dispatch, and those streams
at a copy's speed); with ``--layouts``, ``hidden_over_vocab`` and
``grid_over_vocab``.

Every case starts from the same table (``initial_table``, the PyTorch
workers' too) and takes the same batches of ids in the same order, a new
batch each step (``id_batches``: a Zipf draw of its own seed; they repeat
only after 64 steps), as training does: a step finds the rows of its batch
where the steps before left them, not where its own untimed step just
fetched them. ``--same-ids`` gives every step the first batch instead, the
protocol of the runs kept before 2026-12-07's fifth session, whose rows
stay warm in the caches. The copy, the XLA-hosted rows floor and
``step_bytes`` use the first batch; the bare passes take the batches in turn,
one a round. Each case
prints its loss at step ``LOSS_STEP``, which must agree among the cases of
one rule: row-wise AdaGrad (embedlib's sparse step by all three updates,
FBGEMM's fused), PyTorch's element-wise Adagrad (its two cases; the JAX
dense step's optax rule differs in where it adds eps, see ``ELEMENTWISE``).

Prints min / median / max ms per case and its ratio to the sparse step, the
speed-up (dense median / sparse median; target >= 10), each compiled JAX
step's temporary bytes from XLA's memory analysis beside the table's and
the looked-up rows' bytes (target: no table-sized temporary), its peak
(arguments + outputs that reuse no donated input + temporaries), and the
minor page faults per timed JAX step (on CPU): XLA:CPU allocates a step's
temporaries afresh each step, and glibc serves allocations over its mmap
threshold (at most 32 MiB, and anything over 64 MiB from a thread) with
fresh pages, each first touch a fault (``benchmarks/README.md`` gives the
``MALLOC_*`` environment variables that keep freed blocks instead). Peak RSS
is printed after each table (the process's high-water mark, so it includes
the dense step's). Never asserts a time.
"""

import argparse
import contextlib
import os
import random
import resource
import statistics
import sys
import tempfile
import time

if "--layouts" in sys.argv:  # before jax is imported
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(2, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import embedlib  # noqa: E402
from embedlib import axes, options  # noqa: E402
from embedlib import optim  # noqa: E402
from embedlib.optim import fused_cpu, sorted_update  # noqa: E402
from embedlib.plan import hlo  # noqa: E402
import bandwidth  # noqa: E402
import timing  # noqa: E402
from timing import print_table  # noqa: E402
from worker_protocol import (missing_note, peak_rss_mib, peer_env, sample_ms,  # noqa: E402
                             start_or_note)

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_PYTHON = os.path.join(os.path.dirname(HERE), ".peers", "bin", "python")
TORCH_SCRIPT = os.path.join(HERE, "peers", "torch_sparse_step.py")
FBGEMM = "PyTorch FBGEMM fused row-wise AdaGrad"
PEERS = {  # column -> worker --variant
    FBGEMM: "fused",
    "PyTorch Embedding(sparse=True) + Adagrad": "sparse",
    "PyTorch dense Embedding + Adagrad": "dense",
}
SPARSE, DENSE = "sparse row-wise AdaGrad", "dense nnx.Optimizer(adagrad)"
SPARSE_XLA = "sparse row-wise AdaGrad, XLA ops"
SPARSE_SORTED = "sparse row-wise AdaGrad, sorted (GPU update)"
COPY = "copy of the sparse step's bytes (x + 1)"
DRAM_COPY = "copy past the caches (x + 1)"
ROWS_FLOOR = "rows gathered, then distinct rows written in place"
BARE_PASSES = "bare C++: rows gathered, then distinct rows written in place"
BARE_COPY = "bare C++: copy of the step's bytes (x + 1)"
MiB = 1 << 20
LR = 0.01


def zipf_ids(n, vocab, seed=0):
  """Zipf(1.05) ranks, hashed so the hot rows are spread over the table."""
  rng = np.random.default_rng(seed)
  ranks = rng.zipf(1.05, n).astype(np.uint64)
  return jnp.asarray((ranks * np.uint64(2654435761)) % np.uint64(vocab), jnp.int32)


def initial_table(key, shape, dtype=jnp.float32):
  """Every case's initial table: a hash of each entry's position, in [-1/32, 1/32).

  16-bit integers times a power of two, so the PyTorch workers build the
  same float32 values (``peers/torch_sparse_step.py``) and a case with the
  same rule must end at the same loss.
  """
  del key
  rows, width = shape
  r = jnp.arange(rows, dtype=jnp.uint32)[:, None]
  h = (r * jnp.uint32(width) + jnp.arange(width, dtype=jnp.uint32)) * jnp.uint32(2654435761)
  return ((h >> 16).astype(jnp.float32) * 2.0**-20 - 2.0**-5).astype(dtype)


class Model(nnx.Module):

  def __init__(self, vocab, width, rngs, mesh=None, layout=None):
    self.emb = embedlib.ShardedEmbed(vocab, width, mesh=mesh, layout=layout,
                                     embedding_init=initial_table, rngs=rngs)

  def __call__(self, ids):
    return jnp.mean(jnp.sum(self.emb(ids), axis=-1) ** 2)


def build_step(vocab, width, sparse, mesh=None, layout=None):
  """A jitted ``step(state, ids) -> (loss, state)`` with the state donated.

  ``mesh``, ``layout``: the table's (``ShardedEmbed``'s; an ``embedlib.Layout``).
  """
  model = Model(vocab, width, nnx.Rngs(0), mesh=mesh, layout=layout)
  if sparse:
    opt = optim.SparseAwareOptimizer(model, None, optim.RowWiseAdagrad(LR))
  else:
    # torch.optim.Adagrad's rule: accumulators from 0 (optax's default 0.1
    # would barely move the rows: steps of lr * g / sqrt(0.1)), and eps
    # 1e-10 added after the square root, which optax adds under it: 1e-20
    # there (a row's gradient here is small enough for 1e-10 to matter).
    opt = nnx.Optimizer(model, optax.adagrad(LR, initial_accumulator_value=0.0, eps=1e-20),
                        wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))
  grad = optim.value_and_grad if sparse else nnx.value_and_grad

  def step(state, ids):
    model, opt = nnx.merge(graphdef, state)
    loss, grads = grad(lambda m: m(ids))(model)
    opt.update(model, grads)
    return loss, nnx.state((model, opt))

  return jax.jit(step, donate_argnums=0), state


class Stepper:
  """Calls a donating step, keeping the returned state for the next call.

  ``timed(ids, inner)`` runs ``inner`` steps back to back and returns their
  milliseconds per step, until the last loss and the whole new state are
  ready, and records the minor page faults per step.

  With ``batches``, step k (from 0) takes ``batches[k % len(batches)]``
  and the ``ids`` passed are ignored: every case given the same batches
  sees them in the same order, as the PyTorch workers do.
  """

  def __init__(self, step, state, batches=None):
    self.step, self.state, self.batches = step, state, batches
    self.faults = []
    self.steps, self.loss = 0, None
    self.compared = (None, 0)   # the loss at step LOSS_STEP (or the last, before it)

  def __call__(self, ids):
    if self.batches:
      ids = self.batches[self.steps % len(self.batches)]
    self.loss, self.state = self.step(self.state, ids)
    self.steps += 1
    if self.steps <= LOSS_STEP:
      self.compared = (self.loss, self.steps)
    return self.loss

  def timed(self, ids, inner=1):
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(inner - 1):
      self(ids)
    jax.block_until_ready((self(ids), self.state))
    ms = (time.perf_counter() - start) * 1e3 / inner
    self.faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / inner)
    return ms


def table_and_acc(state):
  """The ``(table, accumulator)`` arrays of a sparse step's state."""
  leaves = dict(jax.tree_util.tree_flatten_with_path(state)[0])
  pick = lambda name: next(
      v for path, v in leaves.items() if any(getattr(k, "key", None) == name for k in path))
  return pick("embedding"), pick("acc")


def dense_adagrad_step(table, acc, ids, eps=1e-8):
  """The reference: one step of the benchmark's loss and row-wise AdaGrad, dense numpy.

  Args:
    table: ``[vocab, width]`` float32.
    acc: ``[vocab]`` float32, the rows' accumulators.
    ids: ``[n]`` int, ``-1`` for an invalid id.
    eps: AdaGrad's epsilon (the benchmark's rule uses 1e-8).

  Returns:
    ``(loss, table, acc)`` after the step; rows no valid id touches unchanged.
  """
  n, width = ids.shape[0], table.shape[1]
  valid = ids[ids >= 0]
  touched = np.zeros(table.shape[0], bool)
  touched[valid] = True
  rows = np.where((ids >= 0)[:, None], table[np.maximum(ids, 0)], 0.0)
  sums = rows.sum(-1)
  grad = np.zeros_like(table)
  np.add.at(grad, valid, np.repeat((2 * sums / n)[ids >= 0, None], width, 1))
  acc = acc + np.where(touched, np.mean(grad**2, axis=1), 0.0)
  table = table - np.where(touched[:, None], LR * grad / (np.sqrt(acc)[:, None] + eps), 0.0)
  return np.mean(sums**2), table, acc


def check(vocab=10_000, width=64, n=8192, steps=3, label="", reference=dense_adagrad_step):
  """Runs sparse steps against ``reference`` (dense numpy AdaGrad); True if they agree.

  Same ids for every step (Zipf, so many repeat; every 97th invalid), the
  benchmark's loss. Touched rows and accumulators must agree within float32
  rounding; untouched ones must be unchanged, bit for bit. Each step starts
  the reference from the sparse step's previous result, so that rounding
  does not accumulate over the steps.
  """
  ids = np.asarray(zipf_ids(n, vocab, seed=1)).copy()
  ids[::97] = -1
  touched = np.zeros(vocab, bool)
  touched[ids[ids >= 0]] = True
  step, state = build_step(vocab, width, True)
  table, acc = (np.array(x, np.float32) for x in table_and_acc(state))
  start_table, start_acc = table.copy(), acc.copy()
  ok = True
  for k in range(steps):
    want_loss, want_table, want_acc = reference(table, acc, ids)
    loss, state = step(state, jnp.asarray(ids))
    got_table, got_acc = (np.asarray(x) for x in table_and_acc(state))
    checks = {
        "loss": np.allclose(float(loss), want_loss, rtol=1e-5),
        "touched rows": np.allclose(got_table[touched], want_table[touched], rtol=1e-5, atol=1e-6),
        "touched accumulators": np.allclose(got_acc[touched], want_acc[touched], rtol=1e-5,
                                            atol=1e-9),
        "untouched rows unchanged": np.array_equal(got_table[~touched], start_table[~touched]),
        "untouched accumulators unchanged": np.array_equal(got_acc[~touched], start_acc[~touched]),
    }
    for what, good in checks.items():
      if not good:
        print(f"check: step {k}: {what} differ from the dense reference")
      ok &= bool(good)
    table, acc = got_table.astype(np.float32), got_acc.astype(np.float32)
  via = f" ({label})" if label else ""
  print(f"check{via}: {steps} sparse row-wise AdaGrad steps on {vocab:,} x {width}, {n:,} ids "
        f"({touched.sum():,} rows touched) on {jax.default_backend()}: "
        f"{'agree with' if ok else 'DIFFER from'} the dense reference")
  return ok


def update_path(path):
  """The update a case traces: None (the platform's own), "xla" (the XLA ops) or "sorted"."""
  if path is None:
    return contextlib.nullcontext()
  if path == "sorted":
    return sorted_update.use(True)
  stack = contextlib.ExitStack()
  stack.enter_context(fused_cpu.use(False))
  stack.enter_context(sorted_update.use(False))
  return stack


#: Cases with the sparse step's rule (row-wise AdaGrad, lr, eps 1e-8,
#: accumulators from 0) from the same table and ids: the same loss.
SAME_RULE = (SPARSE_XLA, SPARSE_SORTED, FBGEMM)
#: PyTorch's element-wise Adagrad cases (one formula): the same loss as
#: each other, another than row-wise AdaGrad's. The JAX dense step is
#: element-wise too, but optax adds eps under the square root: this loss's
#: steps overshoot and oscillate (a row's entries share one gradient), which
#: amplifies that difference, so it is not expected to match them.
ELEMENTWISE = ("PyTorch Embedding(sparse=True) + Adagrad", "PyTorch dense Embedding + Adagrad")


#: The step whose loss the cases compare. The same ids every step
#: (``--same-ids``) drive this loss toward 0: past a few dozen steps it is
#: float32 rounding (near 1e-17 at step 21), where rules that agree differ
#: by tens of percent.
LOSS_STEP = 5


def print_losses(jax_losses, peer_losses):
  """Each case's loss at step ``LOSS_STEP`` (the same batches in the same order) beside ours."""
  ours, steps = jax_losses[SPARSE]
  print(f"loss at step {steps} of each case (same table, same batches): "
        f"sparse row-wise AdaGrad {ours:.6g}")
  losses = {**jax_losses, **peer_losses}
  for name, (loss, n) in losses.items():
    if name == SPARSE:
      continue
    what = "same rule: should agree"
    if name == DENSE:
      what = "optax element-wise Adagrad, eps under the root: not expected to agree"
    elif name in ELEMENTWISE:
      other = losses.get(ELEMENTWISE[1])
      what = ("element-wise Adagrad" if other is None or name == ELEMENTWISE[1] else
              f"element-wise Adagrad: should agree with the dense PyTorch case, relative "
              f"difference {(loss - other[0]) / abs(other[0]):+.1e}")
    print(f"  {name:44s} {loss:.6g} (step {n}; relative difference "
          f"{(loss - ours) / abs(ours):+.1e}; {what})")


def settled_rounds(runs, repeats, seed=0, between_rounds=None):
  """Times every case once per round, shuffled, each after one untimed call.

  Args:
    runs: name -> ``run()``, which performs one step and returns its ms.
    repeats: rounds.
    between_rounds: called after every round (the run's copy probe), or None.

  Returns:
    name -> list of milliseconds.
  """
  times = {name: [] for name in runs}
  rng = random.Random(seed)
  for _ in range(repeats):
    order = list(runs)
    rng.shuffle(order)
    for name in order:
      runs[name]()   # untimed: absorbs what the previous case left behind
      times[name].append(runs[name]())
    if between_rounds is not None:
      between_rounds()
  return times


def steps_per_sample(backend):
  """``--inner``'s default on ``backend``: the steps one timed sample runs back to back."""
  return 8 if backend == "cpu" else 20


def start_peers(args, tmp, batches, vocab, width):
  """Starts the PyTorch workers on ``batches`` (each steps through them in turn, as
  ``Stepper`` does), warmed up by ``LOSS_STEP`` steps as the JAX cases are.

  Returns:
    ``(workers, losses, notes)``: column -> worker, column -> ``(its loss at
    step LOSS_STEP, LOSS_STEP)``, and the lines to print for the columns left out.
  """
  if not args.peers:
    return {}, {}, []
  if jax.default_backend() != "cpu":
    return {}, {}, [f"PyTorch columns left out: they are CPU workers, and jax runs on "
                    f"{jax.default_backend()!r} here."]
  missing = missing_note(args.peer_python)
  if missing:
    return {}, {}, [missing]
  data = os.path.join(tmp, "ids.npz")
  np.savez(data, ids=np.stack([np.asarray(b) for b in batches]))
  env = peer_env(OMP_WAIT_POLICY="PASSIVE")
  workers, losses, notes = {}, {}, []
  for col, variant in PEERS.items():
    if variant not in args.peer_cases:
      continue
    w, info = start_or_note(
        col, [args.peer_python, TORCH_SCRIPT, "--data", data, "--rows", str(vocab),
              "--width", str(width), "--variant", variant, "--warmup", str(LOSS_STEP),
              "--threads", str(args.torch_threads)], env, notes)
    if w is None:
      continue
    print(f"  {col}: " + ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items()))
    workers[col] = w
    losses[col] = (info["first_loss"], LOSS_STEP)
  return workers, losses, notes


def record_ratios(record, times, vocab, width, model_share=None):
  """The table's named ratios, by medians: ``vs_fbgemm_<size>`` (FBGEMM fused's
  time over ours), ``copy_distance_<size>`` (ours over the copy of the step's
  bytes), ``dense_over_sparse_<size>`` (the speed-up over the dense step),
  and the floors' (the module's docstring).

  ``model_share``: ``bandwidth.model_bytes`` over ``step_bytes``' total, for
  ``least_step_over_copy_<size>``.
  """
  tag = timing.size_tag(vocab, width)
  if FBGEMM in times:
    record.ratio(f"vs_fbgemm_{tag}", timing.median_ratio(times[FBGEMM], times[SPARSE]))
  else:
    record.note(f"{tag}: no FBGEMM column, so no vs_fbgemm_{tag}")
  record.ratio(f"copy_distance_{tag}", timing.median_ratio(times[SPARSE], times[COPY]))
  if ROWS_FLOOR in times:
    record.ratio(f"rows_floor_over_copy_{tag}", timing.median_ratio(times[ROWS_FLOOR], times[COPY]))
    record.ratio(f"rows_floor_distance_{tag}", timing.median_ratio(times[SPARSE], times[ROWS_FLOOR]))
  if BARE_PASSES in times:
    record.ratio(f"bare_floor_over_copy_{tag}",
                 timing.median_ratio(times[BARE_PASSES], times[BARE_COPY]))
    record.ratio(f"bare_copy_over_copy_{tag}", timing.median_ratio(times[BARE_COPY], times[COPY]))
    if model_share is not None:
      record.ratio(f"least_step_over_copy_{tag}",
                   timing.median_ratio(times[BARE_PASSES], times[BARE_COPY]) + model_share)
  record.ratio(f"dense_over_sparse_{tag}", timing.median_ratio(times[DENSE], times[SPARSE]))


#: The most batches a run draws; its steps cycle through them.
MAX_BATCHES = 64


def id_batches(n, vocab, steps, same_ids=False):
  """The batches the steps take in turn: one per step, up to ``MAX_BATCHES`` (seeds 0, 1, ...).

  ``same_ids``: the first alone, every step.
  """
  count = 1 if same_ids else max(1, min(steps, MAX_BATCHES))
  return [zipf_ids(n, vocab, seed=seed) for seed in range(count)]


def run(vocab, width, n, repeats, args, record):
  """Times the cases on one table and prints their figures; returns name -> ms per round."""
  # A case steps LOSS_STEP times to warm up, then twice a round (untimed, timed).
  batches = id_batches(n, vocab, LOSS_STEP + 2 * repeats * args.inner, args.same_ids)
  ids = batches[0]
  protocol = ("the first batch of ids every step (--same-ids)" if len(batches) == 1 else
              f"{len(batches)} batches of ids, a new one each step")
  record.note(f"{timing.size_tag(vocab, width)}: {protocol}")
  table_bytes = vocab * width * 4
  rows_bytes = n * width * 4
  steppers, memory = {}, {}
  cases = [(SPARSE, True, None), (DENSE, False, None)]
  if jax.default_backend() != "cpu" or fused_cpu.enabled():
    # The XLA ops: the update GPUs ran before the sorted one, and the CPU's
    # where the fused one does not apply.
    cases.insert(1, (SPARSE_XLA, True, "xla"))
  if jax.default_backend() == "cpu":
    cases.insert(2, (SPARSE_SORTED, True, "sorted"))   # what every other platform runs
  for name, sparse, path in cases:
    step, state = build_step(vocab, width, sparse)
    # Compiled here, inside the path's context: a Compiled is never retraced.
    with update_path(path):
      compiled = step.lower(state, ids).compile()
    memory[name] = compiled.memory_analysis()
    steppers[name] = Stepper(compiled, state, batches)
    for _ in range(LOSS_STEP):   # warm up, to the step whose loss the cases compare
      steppers[name](ids)
    jax.block_until_ready(steppers[name].state)
  uniq = len(np.unique(np.asarray(ids)))
  print(f"\n{vocab:,} x {width} f32 table, {n:,} Zipf(1.05) ids ({uniq:,} distinct in the "
        f"first batch; {protocol})")
  parts = bandwidth.step_bytes(ids, width)
  # A smoke run's DRAM copy: still past the 32 MiB L3, a tenth of the time.
  dram = 128 * MiB if args.quick else bandwidth.DRAM_COPY_BYTES
  copiers = copy_steppers(sum(parts.values()), ids, dram)
  floor = bandwidth.rows_step(vocab, width, ids)
  if floor is not None:
    copiers[ROWS_FLOOR] = Stepper(*floor)
    jax.block_until_ready(copiers[ROWS_FLOOR](ids))
  runs = {name: (lambda s=s: s.timed(ids, args.inner))
          for name, s in {**steppers, **copiers}.items()}
  with tempfile.TemporaryDirectory() as tmp:
    workers, peer_losses, notes = start_peers(args, tmp, batches, vocab, width)
    try:
      for col, w in workers.items():
        runs[col] = lambda w=w: sample_ms(w, args.inner)
      times = settled_rounds(runs, repeats, between_rounds=record.probe)
    finally:
      for w in workers.values():
        w.close()
  if floor is not None:   # on CPU, with a C++ compiler: in its own process, after the rounds
    # Each round on the next batch, as the steps take them.
    bare = bandwidth.bare_floor(vocab, width, np.stack([np.asarray(b) for b in batches]),
                                sum(parts.values()), rounds=max(5, 4 * repeats))
    if bare is not None:
      times[BARE_PASSES], times[BARE_COPY] = bare["two_passes_ms"], bare["copy_ms"]
  record.add_times(times, prefix=f"{timing.size_tag(vocab, width)}: ")
  model_share = bandwidth.model_bytes(ids, width) / sum(parts.values())
  record_ratios(record, times, vocab, width, model_share=model_share)
  per = f", {args.inner} steps per sample" if args.inner > 1 else ""
  print_table(times, SPARSE, f"train step, ms ({repeats} rounds{per})")
  for note in notes:
    print(note)
  print_losses({name: (float(s.compared[0]), s.compared[1]) for name, s in steppers.items()},
               peer_losses)
  sparse_ms, dense_ms = statistics.median(times[SPARSE]), statistics.median(times[DENSE])
  print(f"speed-up (dense median / sparse median): {dense_ms / sparse_ms:.1f}x  (target >= 10x)")
  print(f"table {table_bytes / MiB:.1f} MiB, looked-up rows {rows_bytes / MiB:.1f} MiB")
  bandwidth.print_limit(parts, bandwidth.row_gradient_bytes(ids, width), times[SPARSE],
                        times[COPY], bandwidth.copy_bytes(copiers[COPY].state),
                        times[DRAM_COPY], bandwidth.copy_bytes(copiers[DRAM_COPY].state))
  if ROWS_FLOOR in times:
    floor_ms, copy_ms = statistics.median(times[ROWS_FLOOR]), statistics.median(times[COPY])
    print(f"the step's {n:,} rows gathered, then its {uniq:,} distinct rows read and written "
          f"in place, at their addresses in the {table_bytes / MiB:,.0f} MiB table (medians): "
          f"{floor_ms:.3f} ms, {floor_ms / copy_ms:.1f}x the copy of all the step's bytes; "
          f"the step is {sparse_ms / floor_ms:.1f}x it")
  if BARE_PASSES in times:
    bare_ms, bare_copy_ms = (statistics.median(times[k]) for k in (BARE_PASSES, BARE_COPY))
    print(f"the same two passes in bare C++ (benchmarks/bare_floor.cc, no XLA, "
          f"{len(times[BARE_PASSES])} rounds beside its own copy, medians): {bare_ms:.3f} ms, "
          f"{bare_ms / bare_copy_ms:.2f}x its copy of the step's bytes ({bare_copy_ms:.3f} ms, "
          f"which is {bare_copy_ms / statistics.median(times[COPY]):.2f}x the jitted copy's "
          f"time); the step is {sparse_ms / bare_ms:.1f}x them")
    least = bare_ms / bare_copy_ms + model_share   # least_step_over_copy
    print(f"the least step with its model apart from the lookup: those passes plus the model's "
          f"{bandwidth.model_bytes(ids, width) / MiB:.1f} MiB (rows read, their gradient written "
          f"and read back) at the bare copy's rate: {least * bare_copy_ms:.3f} ms, {least:.2f}x "
          f"the bare copy (least_step_over_copy)")
  for name, mem in memory.items():
    temp = mem.temp_size_in_bytes
    # Live at the step's peak: inputs, temporaries, and outputs that do not
    # reuse a donated input.
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + temp
    faults = (f"; minor page faults per step {statistics.median(steppers[name].faults):,.0f}"
              if jax.default_backend() == "cpu" else "")
    print(f"  {name:32s} compiled temp bytes {temp / MiB:7.1f} MiB "
          f"({temp / rows_bytes:.2f}x rows, {temp / table_bytes:.3f}x table), step peak "
          f"{peak / MiB:7.1f} MiB{faults}")
  print(f"peak RSS so far: {peak_rss_mib():.0f} MiB")
  stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
  if stats and "peak_bytes_in_use" in stats:
    print(f"device peak bytes in use so far: {stats['peak_bytes_in_use'] / MiB:.0f} MiB")
  for stepper in {**steppers, **copiers}.values():
    del stepper.state
  return times


def copy_steppers(step_bytes, ids, dram_bytes):
  """The bandwidth baselines: a copy moving ``step_bytes`` in all, and one of a
  ``dram_bytes`` buffer, past the caches (DRAM)."""
  copiers = {}
  for name, nbytes in ((COPY, step_bytes), (DRAM_COPY, 2 * dram_bytes)):
    copiers[name] = Stepper(*bandwidth.copy_step(nbytes))
    jax.block_until_ready(copiers[name](ids))   # compiled, its pages touched
  return copiers


def layouts(vocab, width, n, repeats, record=None):
  """``--layouts``: the sparse step of vocab, hidden and grid on fsdp=2 x tensor=4."""
  mesh = jax.make_mesh((2, 4), (axes.FSDP, axes.TENSOR))
  rows = dict(table_axes=(axes.TENSOR,))
  kinds = {options.VOCAB: rows, options.HIDDEN: rows,
           options.GRID: dict(rows, column_axes=(axes.FSDP,))}
  ids = jax.device_put(zipf_ids(n, vocab), NamedSharding(mesh, P(axes.FSDP)))
  steppers, lines = {}, []
  for strategy, kwargs in kinds.items():
    layout = embedlib.Layout(sharding=strategy, **kwargs)
    step, state = build_step(vocab, width, True, mesh=mesh, layout=layout)
    compiled = step.lower(state, ids).compile()
    plan = embedlib.plan_embedding(vocab, width, mesh=mesh, **layout.planner_settings())
    steppers[strategy] = Stepper(compiled, state)
    jax.block_until_ready(steppers[strategy](ids))
    lines.append(f"  {strategy:8s} table {plan.bytes_per_device / MiB:8.2f} MiB/device "
                 f"(shard {plan.shard_shape[0]:,} x {plan.shard_shape[1]}), receives "
                 f"{hlo.bytes_moved(compiled.as_text()) / MiB:8.2f} MiB per step")
  runs = {name: (lambda s=s: s.timed(ids)) for name, s in steppers.items()}
  times = settled_rounds(runs, repeats, between_rounds=record and record.probe)
  print_table(times, options.VOCAB, f"fsdp=2 x tensor=4 simulated devices: {vocab:,} x "
              f"{width} f32, {n:,} Zipf ids split over 'fsdp', sparse row-wise AdaGrad "
              f"step, ms ({repeats} rounds)")
  print("\n".join(lines))
  if record is not None:
    record.add_times(times, prefix="fsdp=2 x tensor=4: ")
    for strategy in (options.HIDDEN, options.GRID):
      record.ratio(f"{strategy}_over_vocab", timing.median_ratio(times[strategy],
                                                                  times[options.VOCAB]))
  return times


def build_parser() -> argparse.ArgumentParser:
  """The command line's options."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
  parser.add_argument("--repeats", type=int, default=None, help="timed rounds")
  parser.add_argument("--inner", type=int, default=None,
                      help="steps per timed sample (default 8 on CPU, 20 elsewhere)")
  parser.add_argument("--check", action="store_true",
                      help="first compare the sparse step with a dense reference; exit 1 if they differ")
  parser.add_argument("--no-peers", dest="peers", action="store_false",
                      help="leave out the PyTorch columns")
  parser.add_argument("--layouts", action="store_true",
                      help="instead: vocab, hidden and grid on 8 simulated devices")
  parser.add_argument("--peer-cases", type=lambda v: v.split(","),
                      default=list(PEERS.values()),
                      help="the PyTorch columns to run, of fused,sparse,dense (default all; "
                           "fused alone holds a sixth of their memory at 10M x 32)")
  parser.add_argument("--same-ids", action="store_true",
                      help="every step on the first batch of ids (the protocol of runs kept "
                           "before 2026-12-07's fifth session), not a new batch each step")
  parser.add_argument("--torch-threads", type=int, default=2)
  parser.add_argument("--peer-python", default=PEER_PYTHON,
                      help="python of the peer venv (default .peers/bin/python)")
  timing.add_json_argument(parser)
  return parser


def main(argv=None, reference=dense_adagrad_step) -> int:
  """Runs the benchmark; 1 if ``--check`` finds the sparse step differs from ``reference``."""
  args = build_parser().parse_args(argv)
  record = timing.Run("sparse_step", argv, smoke=args.quick)
  sizes = [(100_000, 64), (1_000_000, 32)] if args.quick else [(1_000_000, 64), (10_000_000, 32)]
  n = 8192 if args.quick else 65_536
  repeats = args.repeats or (3 if args.quick else 10)
  backend = jax.default_backend()
  if args.inner is None:
    args.inner = steps_per_sample(backend)
  print(f"jax {jax.__version__}, backend {backend} ({jax.devices()[0].device_kind}), "
        f"{jax.device_count()} device(s)")
  if args.layouts:
    layouts(*sizes[0], n, repeats, record)
    record.finish(args.json)
    return 0
  if args.check:
    # The platform's own update, then the others it can trace.
    labels = {None: "", "xla": "XLA ops", "sorted": "sorted update"}
    paths = [None, "xla", "sorted"] if backend == "cpu" else [None, "xla"]
    if backend == "cpu" and fused_cpu.enabled():
      labels[None] = "fused CPU update"
    for path in paths:
      with update_path(path):
        if not check(label=labels[path], reference=reference):
          return 1
  for vocab, width in sizes:
    run(vocab, width, n, repeats, args, record)
  record.finish(args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
