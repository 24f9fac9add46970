"""The cases ``gpu_sweep.py`` checks and times: one `Group` per kernel, table and dtype; the two steps.

A group holds its variants (`Case`: the one-call program its check runs, the
timed loop, the switches under which both are traced), the reference its
variants are checked against, and how. Variants (``kernels/rows.py``) are
few, so the sweep fits a GPU session: tile shapes whose threads each issue
16-byte loads (`rows.warps_for`), and one step either side of the default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpu_lookup import xla_bag

QUANTIZED = ("int8", "int4")
#: The sweep's lookup kernels (a case's ``kernel``): the steps' are ``step-...``.
LOOKUPS = ("gather", "bag16", "bag64", "backward", "update-sgd", "update-adagrad", "update-adam")


def _row_bytes(dtype, features):
  if dtype in QUANTIZED:
    return (features if dtype == "int8" else features // 2) + 4
  return features * jnp.dtype(dtype).itemsize


def timed_loop(op, rows: int):
  """``(first, second, inner) -> (acc, out)``: ``inner`` calls of ``op`` in one jitted loop.

  ``inner`` is an argument, so one compiled program serves the check
  (``inner=1``: ``out`` is ``op(first, second)``) and the timing. Each call
  shifts the valid ids (so none is hoisted) and keeps its output (the
  optimization barrier), and its output is the loop's carry.
  """

  def run(first, ids, inner):
    out0 = jax.eval_shape(op, first, ids)

    def body(i, carry):
      acc, _ = carry
      shifted = jnp.where(ids >= 0, (ids + i) % rows, ids)
      out = jax.lax.optimization_barrier(op(first, shifted))
      return acc + out.reshape(-1)[0].astype(jnp.float32), out

    init = (jnp.float32(0), jnp.zeros(out0.shape, out0.dtype))
    return jax.lax.fori_loop(0, inner, body, init)

  return jax.jit(run)


def rows_variants(kind: str, row_bytes: int, count: int, smoke: bool,
                  itemsize: int = 4) -> list[str]:
  """The Triton rows variants swept for ``kind`` (``gather``, ``bag``, ``segment``): names."""
  from embedlib.kernels import rows

  default = rows.default_variant(kind, row_bytes, count, itemsize=itemsize)
  if smoke:
    return [default.name]
  if kind == "gather":
    shapes = [rows.GatherVariant(r, rows.warps_for(r, row_bytes)) for r in (16, 64, 128)]
  elif kind == "bag":
    shapes = [rows.BagVariant(b, u, rows.warps_for(b * u, row_bytes))
              for b, u in ((1, 8), (1, 16), (2, 8), (8, 4))]
  else:
    shapes = [rows.SegmentVariant(p, r, u, rows.warps_for(r, row_bytes))
              for p, r, u in ((8, 32, 2), (32, 64, 2))]
  names = [default.name] + [v.name for v in shapes]
  return list(dict.fromkeys(names))


@dataclasses.dataclass
class Case:
  """One variant: a program compiled once (``fn`` traced on ``abstract``) that checks and times.

  ``make(distribution)`` gives its arguments. A lookup's program is a
  `timed_loop` (its last argument the calls to make); an update's a donated
  step, run ``inner`` times from the host.
  """

  fn: object
  make: object
  context: object = contextlib.nullcontext
  donated: bool = False

  @property
  def abstract(self):
    """The arguments as shapes (lowering needs no data)."""
    return jax.eval_shape(lambda: self.make(None))


@dataclasses.dataclass
class Group:
  """One kernel at one table and dtype: its variants, reference and check."""

  kernel: str
  shape: tuple
  dtype: str
  ids_np: dict
  variants: dict
  reference: object      # () -> the reference output of a variant's one call
  check: object          # (output, reference) -> (ok, message)
  torch: str | None = None
  bag: int | None = None

  @property
  def distributions(self):
    return list(self.ids_np)

  @property
  def label(self):
    return f"{self.shape[0]}x{self.shape[1]} {self.dtype}"


@functools.partial(jax.jit, static_argnames=("tol",))
def _error(got, want, tol):
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  err = jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-30)
  return err, err <= tol


def close(tol):
  """A check: the largest difference over the largest entry, at most ``tol``."""
  def check(got, want):
    err, ok = _error(got, want, tol)
    return bool(ok), f"max err / max {float(err):.2e}"
  return check


def _on_cpu():
  return jax.default_backend() == "cpu"


def _table(rows, features, dtype):
  from embedlib.quant import format as fmt

  dense = jax.random.normal(jax.random.PRNGKey(1), (rows, features), jnp.float32)
  if dtype in QUANTIZED:
    return fmt.quantize_table(dense, bits=8 if dtype == "int8" else 4)
  return dense.astype(dtype)


def lookup_group(kernel, rows, features, dtype, ids_np, *, smoke):
  """``gather`` / ``bagN`` of one table: the rows variants, the earlier kernels, XLA's, torch's."""
  from embedlib import kernels
  from embedlib.kernels import mosaic, reference, rows as rows_lib
  from embedlib.kernels.bag_rows import bag_rows
  from embedlib.kernels.bag_xla import bag_xla
  from embedlib.kernels.gather_rows import gather_rows
  from embedlib.quant import bag_rows as quant_rows
  from embedlib.quant import format as fmt
  from embedlib.quant import lookup as quant_lookup

  bag = None if kernel == "gather" else int(kernel[3:])
  quantized = dtype in QUANTIZED
  table = _table(rows, features, dtype)
  interpret = _on_cpu()
  ids = {d: jnp.asarray(i if bag is None else i.reshape(-1, bag)) for d, i in ids_np.items()}
  first = next(iter(ids))
  count = ids[first].shape[0]
  ops = {}
  if quantized:
    ops["xla"] = ((lambda t, i: quant_lookup.gather(t, i, kernel="xla")) if bag is None else
                  (lambda t, i: quant_lookup.bag(t, i, kernel="xla")))
    ops["triton-tile"] = ((lambda t, i: quant_lookup.gather(t, i, kernel="triton"))
                          if bag is None else (lambda t, i: quant_lookup.bag(t, i, kernel="triton")))
  else:
    ops["xla"] = (lambda t, i: jnp.take(t, i, axis=0)) if bag is None else xla_bag
    if bag is not None:
      ops["xla-slots"] = lambda t, i: bag_xla(t, i)
    if not interpret or mosaic.has_interpreter():
      ops["mosaic-tma"] = ((lambda t, i: kernels.gather(t, i, kernel="mosaic")) if bag is None
                           else (lambda t, i: kernels.bag(t, i, kernel="mosaic")))
    ops["triton-tile"] = ((lambda t, i: kernels.gather(t, i, kernel="triton")) if bag is None
                          else (lambda t, i: kernels.bag(t, i, kernel="triton")))
  kind = "gather" if bag is None else "bag"
  for name in rows_variants(kind, _row_bytes(dtype, features), count, smoke):
    v = rows_lib.parse_variant(name)
    if quantized:
      ops[name] = ((lambda t, i, v=v: quant_rows.gather_rows(t, i, variant=v, interpret=interpret))
                   if bag is None else
                   (lambda t, i, v=v: quant_rows.bag_rows(t, i, variant=v, interpret=interpret)))
    else:
      ops[name] = ((lambda t, i, v=v: gather_rows(t, i, variant=v, interpret=interpret))
                   if bag is None else
                   (lambda t, i, v=v: bag_rows(t, i, variant=v, interpret=interpret)))
  variants = {name: Case(timed_loop(op, rows), lambda d: (table, ids[d or first], jnp.int32(1)))
              for name, op in ops.items()}

  def want():
    exact = fmt.dequantize(table) if quantized else table.astype(jnp.float32)
    if bag is None:
      return reference.gather_reference(exact, ids[first])
    return reference.bag_reference(exact, ids[first])

  tol = 2e-2 if dtype == "bfloat16" else 1e-5
  return Group(kernel, (rows, features), dtype, ids_np, variants, want, close(tol),
               torch=None if quantized else kind, bag=bag)


def backward_group(rows, features, dtype, ids_np, *, smoke):
  """The backward's reduction: one float32 row per distinct id, in id order (``backward``)."""
  from embedlib.kernels import backward_mosaic, mosaic, rows as rows_lib, segment_rows
  from embedlib.optim import sorted_update

  n = len(next(iter(ids_np.values())))
  grads = jax.random.normal(jax.random.PRNGKey(2), (n, features)).astype(dtype)
  ids = {d: jnp.asarray(i) for d, i in ids_np.items()}
  first = next(iter(ids))
  interpret = _on_cpu()

  def xla_sums(g, i):
    _, inverse = jnp.unique(i, size=i.shape[0], return_inverse=True)
    return jnp.zeros(g.shape, jnp.float32).at[inverse.reshape(-1)].add(g.astype(jnp.float32))

  def sorted_sums(g, i):   # the sorted update's scan; each run's sum at its last position
    keys, order = jax.lax.sort((i, jnp.arange(i.shape[0])), num_keys=1)
    sums, last = sorted_update.segmented_sums(keys, g.astype(jnp.float32)[order])
    slot = jnp.cumsum(last) - 1
    return jnp.zeros(g.shape, jnp.float32).at[jnp.where(last, slot, i.shape[0])].set(
        sums, mode="drop", unique_indices=True)

  ops = {"xla": xla_sums, "xla-sorted": sorted_sums}
  if not interpret or mosaic.has_interpreter():
    ops["mosaic-tma"] = lambda g, i: backward_mosaic.row_sums(g, i, rows, interpret=interpret)
  for name in rows_variants("segment", _row_bytes(dtype, features), n, smoke,
                            jnp.dtype(dtype).itemsize):
    v = rows_lib.parse_variant(name)
    ops[name] = lambda g, i, v=v: segment_rows.row_sums(g, i, rows, variant=v,
                                                         interpret=interpret)
  variants = {name: Case(timed_loop(op, rows), lambda d: (grads, ids[d or first], jnp.int32(1)))
              for name, op in ops.items()}
  return Group("backward", (rows, features), dtype, ids_np, variants,
               lambda: xla_sums(grads, ids[first]), close(1e-4))


UPDATE_RULES = ("sgd", "adagrad", "adam")


def update_group(rule_name, rows, features, ids_np, *, smoke):
  """One rule's sparse update of a float32 table, every way, checked against the XLA ops."""
  from embedlib import optim
  from embedlib.kernels import mosaic
  from embedlib.optim import fused_cpu, fused_gpu, sorted_update
  from embedlib.plan import plan_embedding
  from gpu_steps import agree

  rule = {"sgd": optim.SparseSGD(0.01), "adagrad": optim.RowWiseAdagrad(0.01),
          "adam": optim.LazyAdam(0.01)}[rule_name]
  plan = plan_embedding(rows, features)
  n = len(next(iter(ids_np.values())))
  ids = {d: jnp.asarray(i) for d, i in ids_np.items()}
  first = next(iter(ids))
  grads = jax.random.normal(jax.random.PRNGKey(3), (n, features))
  on_cpu = _on_cpu()

  def state():
    table = jax.random.normal(jax.random.PRNGKey(4), (rows, features)) * 0.1
    return table, optim.init_slots(rule, plan, None)

  def step(s, i, g):
    return optim.apply_row_grads(rule, *s, [(i, g)], plan=plan, mesh=None, step=0)

  def switches(*uses):
    def context():
      stack = contextlib.ExitStack()
      stack.enter_context(fused_cpu.use(False))
      for use in uses:
        stack.enter_context(use)
      return stack
    return lambda: context()

  contexts = {"xla-ops": lambda: switches(sorted_update.use(False))(),
              "xla-sorted": lambda: switches(sorted_update.use(True) if on_cpu
                                             else contextlib.nullcontext(),
                                             fused_gpu.use(False))()}
  if not on_cpu or mosaic.has_interpreter():
    contexts["mosaic-tma"] = lambda: switches(
        sorted_update.use(True) if on_cpu else contextlib.nullcontext(), fused_gpu.use(True))()
  for name in rows_variants("segment", features * 4, n, smoke):
    contexts[name] = lambda name=name: switches(
        sorted_update.use(True) if on_cpu else contextlib.nullcontext(), fused_gpu.use(name))()
  variants = {name: Case(jax.jit(step, donate_argnums=0),
                         lambda d: (state(), ids[d or first], grads), context, donated=True)
              for name, context in contexts.items()}

  def check(got, want):
    ok = agree(got, want)
    return ok, "agrees with the XLA ops (rel 1e-4, abs 1e-4)" if ok else "DIFFERS from the XLA ops"

  def want():
    with contexts["xla-ops"]():
      return jax.jit(step, donate_argnums=0)(state(), ids[first], grads)

  return Group(f"update-{rule_name}", (rows, features), "float32", ids_np, variants, want, check)


def group(kernel, rows, features, dtype, ids_np, *, smoke):
  """The `Group` of ``kernel`` at this table and dtype, or None where it has none."""
  if kernel == "gather" or kernel.startswith("bag"):
    return lookup_group(kernel, rows, features, dtype, ids_np, smoke=smoke)
  if dtype in QUANTIZED:
    return None
  if kernel == "backward":
    return backward_group(rows, features, dtype, ids_np, smoke=smoke)
  if kernel.startswith("update-") and dtype == "float32":
    return update_group(kernel.split("-", 1)[1], rows, features, ids_np, smoke=smoke)
  return None


@dataclasses.dataclass
class Step:
  """A train step with ``kernel="auto"`` and ``"xla"``: checked against each other, then timed."""

  kernel: str
  shape: tuple
  ids: str
  build: object      # kernel -> (step(state, batch) -> (loss, state), state, batch)
  inner: int = 10

  def run(self, repeats):
    from embedlib.optim import fused_gpu, sorted_update
    from gpu_steps import agree

    def context(kernel):
      stack = contextlib.ExitStack()
      if _on_cpu():
        stack.enter_context(sorted_update.use(True))
      if kernel == "xla":   # XLA's update too, whatever the table says of the fused one
        stack.enter_context(fused_gpu.use(False))
      return stack

    firsts, times = {}, {}
    for kernel in ("auto", "xla"):
      with context(kernel):
        step, state, batch = self.build(kernel)
        loss, state = step(state, batch)
        firsts[kernel] = float(loss)
        loss, state = step(state, batch)
        firsts[kernel] = (firsts[kernel], float(loss))
        samples = []
        for _ in range(repeats):
          start = time.perf_counter()
          for _ in range(self.inner):
            loss, state = step(state, batch)
          jax.block_until_ready((loss, state))
          samples.append((time.perf_counter() - start) / self.inner)
        times[kernel] = np.array(samples)
    ok = agree(firsts["auto"], firsts["xla"])
    print(f"check {self.kernel}: two steps' losses auto {firsts['auto']} xla {firsts['xla']}: "
          f"{'agree' if ok else 'DIFFER'}")
    return ok, times


def steps(*, smoke):
  """The sparse train step (``gpu_steps.py``'s) and the quickstart DLRM step (batch 65,536)."""
  from flax import nnx

  from configs import quickstart
  from embedlib import data as data_lib
  from embedlib import optim
  from embedlib.training import setup, steps as steps_lib
  from gpu_lookup import make_ids
  from gpu_steps import sparse_loss, sparse_model

  rows, features = (3000, 32) if smoke else (10_000_000, 64)
  ids = jnp.asarray(make_ids(rows, 256 if smoke else 65_536, "zipf").reshape(-1, 16))
  sparse_batch = {"ids": ids, "y": jnp.linspace(-1.0, 1.0, ids.shape[0])}

  def sparse(kernel):
    pair = sparse_model(rows, features, kernel)
    graphdef, state = nnx.split(pair)

    def step(state, batch):
      model, opt = nnx.merge(graphdef, state)
      loss, grads = optim.value_and_grad(lambda m: sparse_loss(m, batch))(model)
      opt.update(model, grads)
      return loss, nnx.state((model, opt))

    return jax.jit(step, donate_argnums=0), state, sparse_batch

  config = quickstart.get_config("smoke" if smoke else None)
  config.batch_size = 64 if smoke else 65_536

  def dlrm(kernel):
    config.model.kernel = kernel
    mesh = setup.make_mesh(config)
    task = setup.task(config)
    spec = task.data_spec()
    batch = data_lib.to_global_batch(next(data_lib.SyntheticSource(spec, batch_size=config.batch_size)),
                                     mesh)
    pair = setup.model_and_optimizer(config, task, spec, mesh)

    def step(pair, batch):
      return steps_lib.train_step(*pair, batch, task=task), pair

    return step, pair, batch

  return [Step("step-sparse", (rows, features), "zipf", sparse, inner=2 if smoke else 10),
          Step("step-dlrm", (config.batch_size, config.model.embed_dim), "synthetic", dlrm,
               inner=2 if smoke else 10)]
