"""The tape ``optim.value_and_grad`` opens: scoped, and loud about lookups it can't record."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import optim, tape


class TwoTables(nnx.Module):
  def __init__(self, rngs):
    self.user = embedlib.ShardedEmbed(10, 4, rngs=rngs)
    self.item = embedlib.ShardedEmbed(12, 4, rngs=rngs)

  def __call__(self, ids):
    return jnp.sum(self.user(ids) * self.item(ids))


@nnx.jit
def embed_items(model, ids):
  return model.item(ids)


def nested_loss(model, ids):
  return jnp.sum(model.user(ids) * embed_items(model, ids))


IDS = jnp.array([[1, 2], [3, -1]])


def test_rows_and_scope():
  model = TwoTables(nnx.Rngs(0))
  loss, grads = optim.value_and_grad(lambda m: m(IDS))(model)
  assert sorted(grads.rows) == ["item", "user"]
  (ids, rows), = grads.rows["user"]
  np.testing.assert_array_equal(ids, IDS)
  np.testing.assert_allclose(rows, model.item(IDS), rtol=1e-6)
  assert tape.active() is None
  assert not hasattr(model.user, "recorded_by_tape")


def test_tape_is_reset_when_the_loss_raises_and_is_per_thread():
  model = TwoTables(nnx.Rngs(0))
  seen = []

  def loss(m):
    t = threading.Thread(target=lambda: seen.append(tape.active()))
    t.start()
    t.join()
    seen.append(tape.active())
    raise RuntimeError("boom")

  with pytest.raises(RuntimeError, match="boom"):
    optim.value_and_grad(loss)(model)
  assert seen[0] is None and seen[1] is not None
  assert tape.active() is None


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "cached-trace"])
def test_lookup_in_a_nested_jit_raises_naming_the_table_and_the_fix(warm):
  model = TwoTables(nnx.Rngs(0))
  if warm:
    embed_items(model, IDS)  # a trace made without the tape, cached by nnx.jit
  with pytest.raises(ValueError, match=r"table 'item' was looked up inside .*nested.*tables=lambda"):
    optim.value_and_grad(nested_loss)(model, IDS)


def test_lookup_under_vmap_raises():
  model = TwoTables(nnx.Rngs(0))

  def loss(m):
    return jnp.sum(jax.vmap(lambda i: m.user(i))(IDS))

  with pytest.raises(ValueError, match="table 'user' was looked up inside"):
    optim.value_and_grad(loss)(model)


def test_nested_jit_of_a_dense_table_is_fine():
  model = TwoTables(nnx.Rngs(0))
  dense_item = lambda key, m: key != "item"
  loss, grads = optim.value_and_grad(nested_loss, tables=dense_item)(model, IDS)
  assert list(grads.rows) == ["user"]
  assert grads.dense["item"]["embedding"][...].shape == (12, 4)
