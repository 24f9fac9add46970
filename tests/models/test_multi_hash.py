"""Multi-hash embeddings: the documented formula, exact on any id, collisions as predicted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embedlib import optim
from embedlib.data import MultiHash, hash_collisions
from embedlib.data.multi_hash import PRIME
from embedlib.models import MultiHashEmbed

IDS = [0, 1, 7, 2**31 - 1, 2**32 + 5, 10**12 + 3, PRIME - 1, PRIME, PRIME + 7, 2**63 - 1]


def _reference(hasher, id_):
  """The docstring's formula on Python ints (no overflow, no numpy)."""
  a, b = hasher.coefficients
  m = hasher.num_buckets - 1
  return [((id_ * int(a_j) + int(b_j)) % PRIME) % m + 1 for a_j, b_j in zip(a, b)]


@pytest.mark.parametrize("num_buckets, num_hashes, seed", [(2, 1, 0), (1000, 2, 0), (2**20, 4, 9)])
def test_rows_follow_the_formula_exactly_for_every_id_width(num_buckets, num_hashes, seed):
  hasher = MultiHash(num_buckets, num_hashes, seed)
  want = np.array([_reference(hasher, i) for i in IDS])
  np.testing.assert_array_equal(hasher(np.array(IDS, np.uint64)), want)
  np.testing.assert_array_equal(hasher(np.array(IDS, np.int64)), want)
  np.testing.assert_array_equal(hasher(np.array(IDS[:4], np.int32)), want[:4])
  assert (hasher([-1, -5]) == 0).all()  # padding


def test_rows_are_pinned_so_every_host_and_release_agrees():
  # Changing the coefficients' derivation silently re-maps every trained table.
  rows = MultiHash(1 << 20, 2, seed=0)(np.array([0, 1, 123456789]))
  assert rows.tolist() == [[585079, 140798], [440971, 1035396], [48004, 999895]]


def test_collisions_match_uniform_hashing():
  ids = np.random.default_rng(0).integers(0, 2**40, 20_000)  # sparse ids, like real ones
  r = hash_collisions(MultiHash(4097, 2, seed=3), ids)
  assert r["ids"] == 20_000 and r["rows"] == 4096
  assert abs(r["per_hash_observed"] - r["per_hash_expected"]) < 0.01 * r["per_hash_expected"]
  # ~24 expected ids share both rows: Poisson-like spread, 5 sigma.
  assert abs(r["all_hashes_observed"] - r["all_hashes_expected"]) < 5 * np.sqrt(r["all_hashes_expected"])
  # Ids far past 2**32 keep apart: no collision in all rows beyond uniform hashing's.
  assert hash_collisions(MultiHash(1 << 24, 3), ids * 4099)["all_hashes_observed"] == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_buckets=1), r"multi_hash.num_buckets must be an int >= 2.*row 0 is reserved"),
    (dict(num_buckets=100, num_hashes=0), r"num_hashes must be an int >= 1"),
    (dict(num_buckets=3, num_hashes=3), r"num_hashes=3 exceeds the 2 rows.*raise num_buckets"),
    (dict(num_buckets=10**6, num_hashes=17), r"at most 16 hash functions"),
])
def test_hash_settings_that_cannot_work_name_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    MultiHash(**kwargs)


def test_embed_pads_to_zero_and_trains_only_the_hashed_rows():
  hasher = MultiHash(64, 2, seed=1)
  emb = MultiHashEmbed(hasher, 4, out_features=6, rngs=nnx.Rngs(0))
  rows = jnp.asarray(hasher(np.array([[3, 9, -1]])))
  out = emb(rows)
  assert out.shape == (1, 3, 6) and not np.asarray(out[0, 2]).any()
  _, grads = optim.value_and_grad(lambda m: jnp.sum(m(rows) ** 2))(emb)
  (ids, row_grads), = grads.rows["table"]
  np.testing.assert_array_equal(ids, np.where(rows == 0, -1, rows))
  assert not np.asarray(row_grads[0, 2]).any()  # the padded id's rows get nothing
  summed = MultiHashEmbed(hasher, 4, combiner="sum", rngs=nnx.Rngs(0))
  table = summed.table.logical_table()
  np.testing.assert_allclose(summed(rows)[0, 0], table[rows[0, 0, 0]] + table[rows[0, 0, 1]])
  with pytest.raises(ValueError, match=r"expected rows \[..., num_hashes=2\].*got shape \(1, 3\)"):
    emb(rows[..., 0])


def test_same_output_on_one_and_eight_devices():
  hasher = MultiHash(1001, 3, seed=2)
  rows = jnp.asarray(hasher(np.arange(-8, 56).reshape(16, 4) * 104729))
  outs = []
  for n in (1, 8):
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    emb = MultiHashEmbed(hasher, 8, out_features=8, mesh=mesh, sharding="vocab", rngs=nnx.Rngs(0))
    outs.append(np.asarray(nnx.jit(lambda m, r: m(r))(emb, rows)))
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-7)
