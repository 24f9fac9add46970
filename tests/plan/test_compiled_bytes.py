"""The planner's bytes moved agree with the collectives XLA compiled (within 10%).

Each case builds a table (or a collection) for a layout, compiles one lookup
with its ids already split over the data axes, reads the bytes each device
receives from the compiled HLO (``embedlib.plan.hlo``) and compares them
with the plan's estimate; one collection's sparse train step too, against
its lookup plus sparse update. 8 devices here, 16 in a subprocess.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import embedlib
from embedlib.collection import estimate_bytes_moved
from embedlib.plan import hlo
from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 0.10
PER_DEVICE = 64  # samples per data shard
BAG = 4


def _mesh(devices, kind):
  if kind == "tokens":  # the recommender layout: data axes = table axes
    return jax.make_mesh((devices,), ("batch",)), {}
  if kind == "tp":  # ids replicated over "model"
    return jax.make_mesh((2, devices // 2), ("data", "model")), {}
  if kind == "fsdp-tp":  # a grid: rows over tensor, columns over fsdp (token ranks)
    return jax.make_mesh((2, devices // 2), ("fsdp", "tensor")), {
        "table_axes": ("tensor",), "column_axes": ("fsdp",)}
  if kind == "rows-tokens":  # a grid: rows over the data axis, columns over model
    return jax.make_mesh((devices // 2, 2), ("data", "model")), {
        "table_axes": ("data",), "column_axes": ("model",)}
  # table over both axes: token ranks and rest ranks
  return jax.make_mesh((devices // 2, 2), ("data", "model")), {"table_axes": ("data", "model")}


def _ids(mesh, plan, shape):
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 5000, (plan.data_shards * shape[0],) + shape[1:]).astype(np.int32)
  return jax.device_put(ids, NamedSharding(mesh, P(plan.data_axes or None)))


def measured(fn, *args):
  return hlo.bytes_moved(jax.jit(fn).lower(*args).compile().as_text())


def table_case(devices, kind, strategy, pooled):
  """``(planned, measured)`` bytes per device of one lookup."""
  mesh, axes = _mesh(devices, kind)
  emb = embedlib.ShardedEmbed(5000, 64, mesh=mesh, sharding=strategy, rngs=nnx.Rngs(0),
                              ids_per_device=PER_DEVICE * (BAG if pooled else 1), **axes)
  plan = emb.plan
  graphdef, state = nnx.split(emb)
  if pooled:
    ids = _ids(mesh, plan, (PER_DEVICE, BAG))
    got = measured(lambda s, i: nnx.merge(graphdef, s).bag(i, combiner="mean"), state, ids)
    want = estimate_bytes_moved(plan, [(BAG, True)], batch_size=PER_DEVICE * plan.data_shards)
  else:
    ids = _ids(mesh, plan, (PER_DEVICE,))
    got = measured(lambda s, i: nnx.merge(graphdef, s)(i), state, ids)
    want = plan.bytes_moved_per_lookup
  return want, got


def collection_case(devices):
  """A collection with one table of each layout, looked up in one step."""
  mesh, _ = _mesh(devices, "tokens")
  tables = [embedlib.TableSpec("v", 5000, 16, sharding="vocab"),
            embedlib.TableSpec("h", 3000, 64, sharding="hidden"),
            embedlib.TableSpec("r", 5000, 32, sharding="routed"),
            embedlib.TableSpec("s", 100, 8, sharding="replicated")]
  features = [embedlib.FeatureSpec("v1", "v", max_ids_per_sample=BAG),
              embedlib.FeatureSpec("h1", "h", combiner=None, max_ids_per_sample=2),
              embedlib.FeatureSpec("r1", "r", max_ids_per_sample=BAG),
              embedlib.FeatureSpec("r2", "r", combiner=None, max_ids_per_sample=1),
              embedlib.FeatureSpec("s1", "s", max_ids_per_sample=1)]
  batch = PER_DEVICE * devices
  coll = embedlib.EmbeddingCollection(tables, features, mesh=mesh, batch_size=batch,
                                      rngs=nnx.Rngs(0))
  plan = coll.tables["v"].plan
  inputs = {"v1": _ids(mesh, plan, (PER_DEVICE, BAG)), "h1": _ids(mesh, plan, (PER_DEVICE, 2)),
            "r1": _ids(mesh, plan, (PER_DEVICE, BAG)), "r2": _ids(mesh, plan, (PER_DEVICE,)),
            "s1": _ids(mesh, plan, (PER_DEVICE,)) % 100}
  graphdef, state = nnx.split(coll)
  return coll.plan.bytes_moved, measured(lambda s, x: nnx.merge(graphdef, s)(x), state, inputs)


def collection_step_case(devices):
  """A routed and a replicated table's sparse train step: ``(planned, compiled)``.

  The plan's lookup plus its sparse update (``bytes_moved_update``: the
  route of the routed table's gradients, the all-reduce of the small one's).
  """
  mesh, _ = _mesh(devices, "tokens")
  tables = [embedlib.TableSpec("r", 5000, 32, sharding="routed"),
            embedlib.TableSpec("s", 100, 8, sharding="replicated")]
  features = [embedlib.FeatureSpec("r1", "r", combiner=None, max_ids_per_sample=BAG),
              embedlib.FeatureSpec("s1", "s", max_ids_per_sample=1)]
  coll = embedlib.EmbeddingCollection(tables, features, mesh=mesh, num_unique=None,
                                      batch_size=PER_DEVICE * devices, rngs=nnx.Rngs(0))
  plan = coll.tables["r"].plan
  assert plan.sparse_update(PER_DEVICE * BAG)[0] == "route"
  assert coll.tables["s"].plan.sparse_update(PER_DEVICE)[0] == "allreduce"
  inputs = {"r1": _ids(mesh, plan, (PER_DEVICE, BAG)), "s1": _ids(mesh, plan, (PER_DEVICE,)) % 100}
  opt = embedlib.SparseAwareOptimizer(coll, None, embedlib.RowWiseAdagrad(0.1))
  graphdef, state = nnx.split((coll, opt))

  def step(state, x):
    m, o = nnx.merge(graphdef, state)
    loss, grads = embedlib.optim.value_and_grad(
        lambda m: sum(jnp.mean(v ** 2) for v in m(x).values()))(m)
    o.update(m, grads)
    return loss, nnx.state((m, o))

  return coll.plan.bytes_moved + coll.plan.bytes_moved_update, measured(step, state, inputs)


CASES = [(kind, strategy, pooled) for kind in ("tokens", "tp", "both")
         for strategy in ("vocab", "hidden", "routed") for pooled in (False, True)]


def run_cases(devices):
  """Every case on ``devices`` devices: ``[(name, planned, measured)]``."""
  out = [(f"{k}-{s}-{'bag' if p else 'rows'}", *table_case(devices, k, s, p))
         for k, s, p in CASES]
  out.append(("collection", *collection_case(devices)))
  return out


def _check(results):
  for name, want, got in results:
    assert got > 0, name
    assert abs(want - got) <= TOLERANCE * got, f"{name}: planned {want}, compiled {got}"


@pytest.mark.parametrize("kind, strategy, pooled", CASES)
def test_eight_devices(kind, strategy, pooled):
  want, got = table_case(8, kind, strategy, pooled)
  _check([(f"{kind}-{strategy}", want, got)])


@pytest.mark.parametrize("pooled", [False, True], ids=["rows", "bag"])
@pytest.mark.parametrize("kind", ["fsdp-tp", "rows-tokens"])
def test_eight_devices_grid(kind, pooled):
  want, got = table_case(8, kind, "grid", pooled)
  _check([(f"{kind}-grid", want, got)])


def test_eight_devices_collection():
  _check([("collection", *collection_case(8))])


def test_eight_devices_collection_sparse_step():
  _check([("collection step", *collection_step_case(8))])


# The eight-device cases above check every plan in CI; sixteen, in a fresh
# process of its own: -m slow.
@pytest.mark.slow
def test_sixteen_devices_in_subprocess():
  script = textwrap.dedent("""
      from tests.plan.test_compiled_bytes import run_cases
      for name, want, got in run_cases(16):
        print(name, want, got)
  """)
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                          env=xla_env.subprocess_env(16),
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [line.split() for line in result.stdout.splitlines()]
  assert len(rows) == len(CASES) + 1
  _check([(name, int(want), int(got)) for name, want, got in rows])
