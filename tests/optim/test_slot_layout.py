"""Optimizer slots are built shard by shard, laid out like the table they update.

``init_slots`` fills each slot with ``jnp.full(..., device=sharding)``, which
builds one shard and places it per device (``jax.make_array_from_callback``),
so no device ever holds a slot it doesn't own. Table-shaped slots (LazyAdam's
moments) are split like the table; row slots (one value per row) are split
with vocab rows, and whole on every rank of a hidden table, whose ranks each
hold every row (a slice of its columns): 1 / features of the table.
"""

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
