"""One ``layout=`` value per table: short constructors, old keywords warning for one release.

Every old keyword must build the module the new spelling builds (the same
plan, kernel, rules), warn once with a ``DeprecationWarning`` that shows the
new spelling and points at the caller's line; ``nnx.Embed``'s arguments
work unchanged and warn nothing.
"""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import CollectionLayout, DynamicSpec, FeatureSpec, Layout, TableSpec

from .contract import make_mesh

MOST_ARGUMENTS = 10


@pytest.mark.parametrize("cls", ["ShardedEmbed", "DynamicEmbed", "QuantizedEmbed",
                                 "EmbeddingCollection"])
def test_constructors_take_at_most_ten_arguments(cls):
  params = dict(inspect.signature(getattr(embedlib, cls).__init__).parameters)  # as help() shows
  del params["self"]
  assert len(params) <= MOST_ARGUMENTS, list(params)
  assert not any(p.kind == p.VAR_KEYWORD for p in params.values())


def test_nnx_embed_arguments_work_unchanged_and_warn_nothing():
  init = nnx.initializers.normal(0.5)
  kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, embedding_init=init)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    emb = embedlib.ShardedEmbed(10, 4, **kw, rngs=nnx.Rngs(3))
  ref = nnx.Embed(10, 4, **kw, rngs=nnx.Rngs(3))
  ids = jnp.array([0, 9, 3])
  np.testing.assert_array_equal(emb.embedding[...], ref.embedding[...])
  np.testing.assert_array_equal(emb(ids), ref(ids))
  assert emb(ids).dtype == jnp.bfloat16


def _same_table(a, b):
  assert a.plan == b.plan
  assert (a.kernel, a.invalid_ids, a.on_overflow, a.mesh) == (b.kernel, b.invalid_ids,
                                                               b.on_overflow, b.mesh)
  np.testing.assert_array_equal(a.physical_table(), b.physical_table())


OLD_TABLE_KEYWORDS = {
    "sharding": dict(sharding="vocab", table_axes=("model",), data_axes=("data",)),
    "grid": dict(sharding="grid", table_axes=("model",), column_axes=("data",)),
    "tied": dict(tied=True, kernel="xla", invalid_ids="error"),
    "routed": dict(sharding="routed", table_axes=("data", "model"),
                   data_axes=("data", "model"), route_capacity=8, on_overflow="error"),
    "planner": dict(replicate_below_bytes=0, ids_per_device=64,
                    device_memory_bytes=1 << 20, optimizer="sgd"),
}


@pytest.mark.parametrize("case", OLD_TABLE_KEYWORDS)
def test_old_table_keywords_build_the_same_table_and_warn(case):
  kw = OLD_TABLE_KEYWORDS[case]
  mesh = make_mesh((2, 4), ("data", "model"))
  new = embedlib.ShardedEmbed(99, 6, mesh=mesh, layout=Layout(**kw), rngs=nnx.Rngs(0))
  with pytest.warns(DeprecationWarning) as caught:
    old = embedlib.ShardedEmbed(99, 6, mesh=mesh, rngs=nnx.Rngs(0), **kw)
  _same_table(old, new)
  (warning,) = caught
  message = str(warning.message)
  assert "layout=embedlib.Layout(" in message and "embedlib 0.2" in message
  assert all(f"{k}=..." in message for k in kw), message
  assert warning.filename == __file__  # the caller's line, not embedlib's or flax's


def test_old_promote_dtype_keyword_sets_the_attribute():
  promote = lambda args, dtype=None, inexact=True: args  # noqa: E731
  with pytest.warns(DeprecationWarning, match=r"set emb.promote_dtype = fn"):
    emb = embedlib.ShardedEmbed(5, 2, promote_dtype=promote, rngs=nnx.Rngs(0))
  assert emb.promote_dtype is promote


def test_a_setting_given_twice_is_refused():
  with pytest.raises(ValueError, match=r"sharding= is given both as a keyword and in layout="):
    with pytest.warns(DeprecationWarning):
      embedlib.ShardedEmbed(8, 2, layout=Layout(sharding="vocab"), sharding="hidden",
                            rngs=nnx.Rngs(0))


def test_old_dynamic_keywords_build_the_same_table_and_warn():
  mesh = make_mesh((2, 4), ("data", "model"))
  new = embedlib.DynamicEmbed(
      512, 4, dynamic=DynamicSpec(bucket_size=32, admit_after=2, default="learned"), mesh=mesh,
      layout=Layout(sharding="routed", table_axes=("model",), route_capacity=16),
      rngs=nnx.Rngs(0))
  with pytest.warns(DeprecationWarning) as caught:
    old = embedlib.DynamicEmbed(512, 4, bucket_size=32, admit_after=2, default="learned",
                                mesh=mesh, sharding="routed", table_axes=("model",),
                                route_capacity=16, rngs=nnx.Rngs(0))
  messages = " ".join(str(w.message) for w in caught)
  assert "layout=embedlib.Layout(" in messages and "dynamic=embedlib.DynamicSpec(" in messages
  assert old.policy == new.policy and old.route_capacity == new.route_capacity == 16
  _same_table(old.rows, new.rows)
  assert old.default_row is not None


def test_dynamic_layout_refuses_what_a_dynamic_table_has_not():
  with pytest.raises(ValueError, match=r"users: Layout\(tied=...\) is not a dynamic table's"):
    embedlib.DynamicEmbed(128, 4, layout=Layout(tied=True), name="users", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"route_capacity is given twice"):
    embedlib.DynamicEmbed(128, 4, dynamic=DynamicSpec(route_capacity=4),
                          layout=Layout(route_capacity=8), rngs=nnx.Rngs(0))


def test_a_small_dynamic_table_just_works():
  emb = embedlib.DynamicEmbed(64, 4, rngs=nnx.Rngs(0))
  assert emb.policy.bucket_size == 64
  rows = emb.rows_of(np.array([5, 7, 5], np.int64))
  assert rows[0] == rows[2] and rows[0] != rows[1]


def test_every_table_kind_reads_the_current_mesh():
  mesh = jax.make_mesh((8,), ("shard",))
  with jax.set_mesh(mesh):
    fixed = embedlib.ShardedEmbed(262144, 64, rngs=nnx.Rngs(0))
    dynamic = embedlib.DynamicEmbed(262144, 64, rngs=nnx.Rngs(0))
  assert fixed.mesh is not None and dynamic.mesh is not None
  assert fixed.plan.table_axes == dynamic.rows.plan.table_axes == ("shard",)
  assert dynamic.rows.plan.strategy == "vocab" and dynamic.policy.bucket_size == 128
  assert dynamic.rows.plan.shard_shape[0] == 262144 // 8  # not whole on every device


def test_old_collection_keywords_build_the_same_collection_and_warn():
  tables = [TableSpec("item", 1000, 8), TableSpec("tag", 30, 4, sharding="table")]
  features = [FeatureSpec("a", "item"), FeatureSpec("b", "tag")]
  kw = dict(num_unique=8, replicate_below_bytes=0, table_batched=True, batch_size=64,
            on_overflow="error")
  mesh = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
  new = embedlib.EmbeddingCollection(tables, features, mesh=mesh,
                                     layout=CollectionLayout(**kw), rngs=nnx.Rngs(0))
  with pytest.warns(DeprecationWarning, match=r"layout=embedlib.CollectionLayout\("):
    old = embedlib.EmbeddingCollection(tables, features, mesh=mesh, rngs=nnx.Rngs(0), **kw)
  assert old.plan == new.plan and old.num_unique == new.num_unique
  assert old.on_overflow == new.on_overflow == "error"
