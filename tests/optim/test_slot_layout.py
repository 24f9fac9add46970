"""Optimizer slots are built shard by shard, laid out like the table they update.

``init_slots`` fills each slot with ``jnp.full(..., device=sharding)``, which
builds one shard and places it per device (``jax.make_array_from_callback``),
so no device ever holds a slot it doesn't own. Table-shaped slots (LazyAdam's
moments) are split like the table; row slots (one value per row) are split
with vocab rows, and whole on every rank of a hidden table, whose ranks each
hold every row (a slice of its columns): 1 / features of the table.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import embedlib
from embedlib import optim
from embedlib.optim import apply as apply_lib
from embedlib.optim import rules

from ..embed.contract import make_mesh


@pytest.mark.parametrize("sharding", ["vocab", "hidden", "replicated"])
@pytest.mark.parametrize("rule", [optim.RowWiseAdagrad(0.1), optim.LazyAdam(0.1)],
                         ids=["adagrad", "lazy_adam"])
def test_slots_are_split_like_their_table(sharding, rule):
  mesh = make_mesh((8,), ("batch",))
  emb = embedlib.ShardedEmbed(1001, 30, mesh=mesh, sharding=sharding, rngs=nnx.Rngs(0))
  slots = apply_lib.init_slots(rule, emb.plan, mesh)
  for name, slot in rule.slots().items():
    value = slots[name]
    want = NamedSharding(mesh, P(*apply_lib.slot_spec(slot, emb.plan)))
    assert value.shape == apply_lib.slot_shape(slot, emb.plan)
    assert value.sharding.is_equivalent_to(want, value.ndim), name
    shard = want.shard_shape(value.shape)
    assert {s.data.shape for s in value.addressable_shards} == {shard}, name
    if slot.kind == rules.TABLE:
      assert shard == emb.plan.shard_shape
    assert (np.asarray(value) == slot.init).all(), name


def test_the_optimizer_holds_the_slots_built_not_copies(monkeypatch):
  # flax's eager sharding would place each slot again: a second copy of
  # every slot while the optimizer is built.
  built = []
  init_slots = apply_lib.init_slots
  monkeypatch.setattr(apply_lib, "init_slots",
                      lambda *a: built.append(init_slots(*a)) or built[-1])
  mesh = make_mesh((8,), ("batch",))
  model = embedlib.ShardedEmbed(64, 16, mesh=mesh, sharding="vocab", rngs=nnx.Rngs(0))
  rule = optim.LazyAdam(0.1)
  opt = optim.SparseAwareOptimizer(model, None, rule)
  pointers = lambda a: [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
  for name, slot in opt.slots[0].items():
    assert pointers(slot[...]) == pointers(built[0][name]), name
    want = P(*apply_lib.slot_spec(rule.slots()[name], model.plan))
    assert nnx.get_partition_spec(nnx.state(opt.slots[0]))[name].get_value() == want, name


@pytest.mark.parametrize("sharding", ["vocab", "hidden"])
def test_an_abstract_build_shards_the_slots_as_a_concrete_one(sharding):
  """``nnx.eval_shape`` (checkpoint restore targets, AOT compiles) types each slot as built.

  Traced, ``jnp.full(..., device=)`` leaves its value replicated; the
  abstract optimizer would then hold every slot whole on each device.
  """
  mesh = make_mesh((2, 4), ("data", "model"))

  def build():
    emb = embedlib.ShardedEmbed(1001, 32, mesh=mesh, sharding=sharding, rngs=nnx.Rngs(0))
    return optim.SparseAwareOptimizer(emb, None, optim.LazyAdam(0.1))

  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    abstract = nnx.state(nnx.eval_shape(build).slots)
  concrete = nnx.state(build().slots)
  pairs = list(zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete)))
  assert len(pairs) == 3   # count, m, v
  for got, want in pairs:
    assert got.shape == want.shape
    assert tuple(got.sharding.spec) == tuple(want.sharding.spec), (got.sharding, want.sharding)
  assert any(a is not None for a in pairs[1][1].sharding.spec)   # the moments are split
