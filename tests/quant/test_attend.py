"""A quantized table's ``attend``: the float attend of its dequantized table, in every layout.

The oracle is the single-device ``query @ dequantized().T``, and beside it
the float twin (`tests.quant.twin`: the float module holding the
dequantized table in the same layout) run through the same program.
Tolerance: fp32 rounding only. The quantized product sums ``s (q . c) + b
sum(q)`` per row block where the float one sums ``q . fl(c s + b)``
(`embedlib.quant.scores`), so a logit may differ by ``2 (F + 4) 2**-24
sum_j |q_j| (|c_j| s + |b|)``, ``F`` the table's columns; that sum is at
most ``|q| . (|x'| + 2 |b|)`` (``x'`` the dequantized row, ``b`` its
bias), which the tests compute (`tests.quant.twin.attend_bound`); bf16
(no scale, no bias) has the same bound. All formats run in one layout
(vocab, 99 rows over 8 devices) and all layouts in one format (int4: its
packed odd-width blocks, 10 columns over 4 giving blocks of 3, or over 2
giving blocks of 5).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import embedlib
from embedlib.quant import format as fmt
from embedlib.quant import scores as scores_lib
from tests.embed.contract import make_mesh
from tests.quant.twin import attend_bound, quantized_and_twin

ROWS, FEATURES, TOKENS = 99, 10, 6  # 99 rows and 10 columns divide no group here

def _host(x):
  return np.asarray(jax.device_get(x), np.float32)


def _query(seed=1, tokens=TOKENS):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(tokens, FEATURES)), jnp.float32)


@nnx.jit
def _both(q, twin, query):
  return q.attend(query), twin.attend(query)


def _check(q, twin, query):
  got, want = _both(q, twin, query)
  assert got.shape == want.shape == (query.shape[0], ROWS) and got.dtype == jnp.float32
  bound = attend_bound(q, query)
  oracle = _host(query) @ _host(q.dequantized()).T
  for other in (want, oracle):
    err = np.abs(_host(got) - _host(other))
    assert (err <= bound).all(), (err / bound).max()
  return got


@pytest.fixture(scope="module")
def mesh8():
  return make_mesh((8,), ("batch",))


@pytest.mark.parametrize("bits", fmt.FORMATS)
def test_every_format_in_the_vocab_layout(bits, mesh8):
  emb = embedlib.ShardedEmbed(ROWS, FEATURES, mesh=mesh8, sharding="vocab", rngs=nnx.Rngs(0))
  q, twin = quantized_and_twin(emb, bits)
  assert q.plan.padded_shape[0] == 104  # 13 rows a device, 5 of them padding
  got = _check(q, twin, _query())
  # Close to the float table too: the format's error, not rounding.
  assert not np.array_equal(_host(got), _host(emb.attend(_query())))


@pytest.mark.parametrize("layout", ["replicated", "vocab", "hidden", "routed", "grid"])
def test_every_layout_int4(layout):
  mesh = make_mesh((2, 4), ("data", "model"))
  kw = dict(table_axes=("model",), column_axes=("data",)) if layout == "grid" else {}
  emb = embedlib.ShardedEmbed(ROWS, FEATURES, mesh=mesh, sharding=layout, rngs=nnx.Rngs(2), **kw)
  q, twin = quantized_and_twin(emb, 4)
  assert q.plan.strategy == layout
  _check(q, twin, _query())


def test_vocab_parallel_logits_of_an_uneven_split():
  """``out_sharding`` over the table's own axes: each device's block, 99 rows over 4."""
  mesh = make_mesh((2, 4), ("data", "model"))
  emb = embedlib.ShardedEmbed(ROWS, FEATURES, mesh=mesh, sharding="vocab", rngs=nnx.Rngs(3))
  q, twin = quantized_and_twin(emb, 8)
  spec = P(None, "model")
  attend = nnx.jit(lambda m, x: m.attend(x, out_sharding=spec))
  query = _query(seed=4)
  got, want = attend(q, query), attend(twin, query)
  assert isinstance(got, embedlib.VocabShardedLogits) and got.shape == (TOKENS, ROWS)
  assert got.padded.shape == (TOKENS, 100) and got.padded.sharding.spec == spec
  err = np.abs(_host(got.unpadded()) - _host(want.unpadded()))
  assert (err <= attend_bound(q, query)).all()
  # The vocab-parallel loss takes them as the float ones.
  labels = jnp.array([0, 98, 5, -1, 40, 7])
  np.testing.assert_allclose(
      float(embedlib.vocab_parallel_cross_entropy(got, labels, reduction="mean")),
      float(embedlib.vocab_parallel_cross_entropy(want, labels, reduction="mean")), rtol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_row_chunks_and_one_device(bits):
  """Scored a chunk of rows at a time (16: six chunks and 3 rows) as in one product."""
  emb = embedlib.ShardedEmbed(ROWS, FEATURES, rngs=nnx.Rngs(5))
  q, twin = quantized_and_twin(emb, bits)
  query = _query(seed=6)
  whole = _check(q, twin, query)
  chunked = scores_lib.scores(query, q.physical_table(), chunk_rows=16)
  assert (np.abs(_host(chunked) - _host(whole)) <= attend_bound(q, query)).all()
  # Any leading shape, returned in the query's dtype.
  three = q.attend(query.reshape(2, 3, FEATURES).astype(jnp.bfloat16))
  assert three.shape == (2, 3, ROWS) and three.dtype == jnp.float32  # the module's dtype


def test_row_chunks_inside_the_layouts_shard_map(mesh8, monkeypatch):
  """Shards of 13 rows scored 5 at a time (a loop in each device's program)."""
  monkeypatch.setattr(scores_lib, "CHUNK_BYTES", 4 * FEATURES * 5)
  emb = embedlib.ShardedEmbed(ROWS, FEATURES, mesh=mesh8, sharding="vocab", rngs=nnx.Rngs(7))
  q, twin = quantized_and_twin(emb, 8)
  query = _query(seed=8)
  got = nnx.jit(lambda m, x: m.attend(x))(q, query)  # a jit of its own: traced with the patch
  err = np.abs(_host(got) - _host(twin.attend(query)))
  assert (err <= attend_bound(q, query)).all()


def test_a_tape_refuses_attend():
  q = embedlib.quantize(embedlib.ShardedEmbed(10, 4, rngs=nnx.Rngs(0)), 8)
  with pytest.raises(ValueError, match="train the float module"):
    embedlib.optim.value_and_grad(lambda m: jnp.sum(m.attend(jnp.ones((1, 4)))))(q)
