"""A collection across nodes: its tables and stacks take the two-level route, and stay exact.

8 simulated devices as 2 nodes of 4 (``devices_per_node=4``): a model of
two collections, one with a routed table of its own, one stacking a routed
table with a table-wise one (``table_batched``).
Their node capacities (2 and 3 distinct ids per destination from each
node) hold some steps and not others, which then cross with the flat
route's buffers (``crowded``). Outputs and gradients are checked against
the unsharded reference (``tests/collection/reference.py``), a sparse step
against the same model on one node. Tolerance: f32 sums in another order
(a node sums its repeats before crossing), 1e-5 relative.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from embedlib import EmbeddingCollection, FeatureSpec, TableSpec, optim
from embedlib.collection import plan_collection, traffic
from embedlib.plan import hlo
from tests.collection import check

APART = (
    TableSpec("tags", 90, 8, sharding="routed"),
)
APART_FEATURES = (
    FeatureSpec("f_tags", "tags", combiner="mean"),
    FeatureSpec("f_tag_seq", "tags", combiner=None),
)
STACKED = (
    TableSpec("big", 300, 8, sharding="routed"),
    TableSpec("a", 40, 8, sharding="table"),
)
STACKED_FEATURES = (
    FeatureSpec("f_big", "big", combiner="sqrtn"),
    FeatureSpec("f_a", "a", combiner=None),
)
BATCH = 16
ROWS = {t.name: t.num_embeddings for t in APART + STACKED}
SHAPES = {"f_tags": (BATCH, 3), "f_tag_seq": (BATCH, 2), "f_big": (BATCH, 3), "f_a": (BATCH, 2)}
TABLE_OF = {f.name: f.table for f in APART_FEATURES + STACKED_FEATURES}


class Model(nnx.Module):

  def __init__(self, mesh, **kw):
    common = dict(mesh=mesh, batch_size=BATCH, rngs=nnx.Rngs(0), **kw)
    nodes = bool(kw)
    self.apart = EmbeddingCollection(APART, APART_FEATURES,
                                     node_capacity={"tags": 2} if nodes else None, **common)
    self.stacked = EmbeddingCollection(STACKED, STACKED_FEATURES, table_batched=True,
                                       node_capacity={"stack_8": 3} if nodes else None, **common)

  def __call__(self, x):
    out = self.apart({f.name: x[f.name] for f in APART_FEATURES})
    out.update(self.stacked({f.name: x[f.name] for f in STACKED_FEATURES}))
    return out


def make_inputs(seed):
  rng = np.random.default_rng(seed)
  x = {k: rng.integers(-1, ROWS[TABLE_OF[k]] + 1, shape) for k, shape in SHAPES.items()}
  x["f_tags"][::3, 0] = 5  # a hot id, asked on every rank
  x["f_big"][::3, 1] = 7
  return x


def logical_tables(model):
  return {t.name: jnp.asarray(np.asarray(c.logical_table(t.name)))
          for c in (model.apart, model.stacked) for t in c.table_specs}


@pytest.fixture(scope="module")
def models():
  mesh = jax.make_mesh((8,), ("batch",))
  return mesh, Model(mesh, devices_per_node=4), Model(mesh)


def test_the_plans_take_two_levels_and_print_their_bytes(models):
  _, nodes, flat = models
  tags, stack = nodes.apart.plan["tags"].plan, nodes.stacked.plan.stack("stack_8").plan
  assert tags.node_route and tags.node_capacity == 2 and tags.nodes == 2
  assert stack.node_route and stack.node_capacity == 3 and stack.nodes == 2
  for p in (tags, stack):  # the sparse step's row gradients take two levels too
    assert p.node_update and p.sparse_update(p.ids_per_device)[0] == "route", p.name
  # The modules were built on the plans (ShardedEmbed's own plan agrees).
  assert nodes.apart.tables["tags"].plan.node_route
  assert nodes.stacked.stacks["stack_8"].plan.node_route
  assert not flat.apart.plan["tags"].plan.node_route
  assert not flat.stacked.plan.stack("stack_8").plan.node_route
  text = " ".join(str(nodes.stacked.plan).split())
  assert "2 tables, one route per step across nodes " in text
  assert "inside its node of 4; 2 nodes, two-level route); its update " in text
  assert "across nodes" not in str(flat.apart.plan)
  # A two-level route moves fewer bytes across nodes than the flat one (4 of its 7 peers).
  intra, inter = tags.node_bytes()
  assert inter < sum(flat.apart.plan["tags"].plan.node_bytes()) * 4 / 7


def test_the_stacks_bytes_across_nodes_are_what_xla_compiled(models):
  mesh, nodes, _ = models
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
  x = {f.name: jax.device_put(jnp.asarray(make_inputs(0)[f.name]), split)
       for f in STACKED_FEATURES}
  graphdef, state = nnx.split(nodes.stacked)
  text = jax.jit(lambda s: nnx.merge(graphdef, s)(x)).lower(state).compile().as_text()
  stack = nodes.stacked.plan.stack("stack_8")
  # The step that holds its node capacity (hlo counts a conditional's normal branch).
  assert hlo.inter_node_bytes(text, 4) == traffic.node_split(stack.plan, stack.bytes_moved)[1]


def test_outputs_and_gradients_match_reference(models):
  mesh, model, _ = models
  inputs = make_inputs(0)
  features = APART_FEATURES + STACKED_FEATURES
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
  x = {k: jax.device_put(jnp.asarray(v), split) for k, v in inputs.items()}
  got, grads, want, want_grads = check.outputs_and_gradients(
      model, lambda m: m(x), logical_tables(model), features, inputs, {}, seed=1)
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6,
                               err_msg=k)
  got_grads = {n: np.asarray(grads["apart"]["tables"][n]["embedding"][...])
               for n in ("tags",)}
  placement = model.stacked.plan.stack("stack_8").plan.placement
  stacked = np.asarray(grads["stacked"]["stacks"]["stack_8"]["embedding"][...])
  for member, rows in placement.members:
    start = placement.start(member)
    got_grads[member] = stacked[start:start + rows]
  for name, g in want_grads.items():
    assert np.abs(g).sum() > 0, name
    np.testing.assert_allclose(got_grads[name][:, :g.shape[1]], g, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_a_sparse_step_equals_the_flat_collections(models):
  mesh, nodes, flat = models
  before = logical_tables(nodes)
  for name, table in logical_tables(flat).items():
    np.testing.assert_array_equal(before[name], table, err_msg=name)
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
  x = {k: jax.device_put(jnp.asarray(v), split) for k, v in make_inputs(2).items()}

  @nnx.jit
  def step(model, opt):
    loss_fn = lambda m: sum(jnp.sum(v ** 2 * jnp.linspace(-1.0, 2.0, v.shape[-1]))
                            for v in m(x).values())
    loss, grads = optim.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  losses = []
  for model in (nodes, flat):
    opt = optim.SparseAwareOptimizer(model, optax.sgd(0.1), optim.RowWiseAdagrad(0.3))
    losses.append(float(step(model, opt)))
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
  after, want = logical_tables(nodes), logical_tables(flat)
  for name in want:
    assert not np.array_equal(after[name], before[name]), name  # the step moved it
    np.testing.assert_allclose(after[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_auto_counts_a_byte_across_nodes_as_costlier():
  tables = [TableSpec("t", 1000, 16)]
  feats = [FeatureSpec("f", "t", max_ids_per_sample=8)]
  kw = dict(mesh={"batch": 8}, batch_size=512, replicate_below_bytes=0)
  flat, nodes = plan_collection(tables, feats, **kw), plan_collection(
      tables, feats, devices_per_node=4, **kw)
  # Each node asks most of a destination's 125 rows: once per node pair is
  # cheaper than vocab's pooled rows from every rank across nodes.
  assert (flat["t"].plan.strategy, nodes["t"].plan.strategy) == ("vocab", "routed")
  assert "a byte across nodes counted 8x" in nodes["t"].plan.reason
  assert nodes["t"].plan.node_route


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices_per_node=3), r"tags: devices_per_node=3 doesn't divide the table group of 8 "
                               r"devices .* pass one of \[1, 2, 4, 8\]"),
    (dict(node_capacity={"nope": 4}), r"node_capacity names table 'nope', which is not in the "
                                      r"collection"),
    (dict(node_capacity={"big": 4}, table_batched=True),
     r"node_capacity names table 'big', which lives in stack 'stack_8' .*"
     r"pass node_capacity=\{'stack_8': N\}"),
])
def test_bad_node_options_name_the_table_and_the_fix(kwargs, match):
  mesh = jax.make_mesh((8,), ("batch",))
  tables = (APART[0], STACKED[0]) if "table_batched" in kwargs else APART[:1]
  feats = [FeatureSpec(f"f_{t.name}", t.name) for t in tables]
  with pytest.raises(ValueError, match=match):
    EmbeddingCollection(tables, feats, mesh=mesh, rngs=nnx.Rngs(0), **kwargs)
