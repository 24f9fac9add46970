"""The planner's distinct-id estimate for skewed ids, against exact sums and sampled ids."""

import math

import numpy as np
import pytest

from embedlib.plan import cost


def zipf_probabilities(rows, skew):
  p = np.arange(1, rows + 1, dtype=np.float64) ** -skew
  return p / p.sum()


@pytest.mark.parametrize("ids,rows,skew", [
    (16_384, 250_000, 1.05), (4_096, 100_000, 0.5), (4_096, 2_000, 0.8), (65_536, 2 * 10**6, 1.1),
    (100, 5_000, 2.0), (4_096, 3_000, 0.0),
])
def test_distinct_ids_mean_equals_the_exact_sum_over_rows(ids, rows, skew):
  missed = np.exp(ids * np.log1p(-zipf_probabilities(rows, skew)))
  assert cost.distinct_ids(ids, rows, skew)[0] == pytest.approx((1 - missed).sum(), rel=1e-6)


@pytest.mark.parametrize("ids,rows,skew", [
    (512, 2_000, 0.9), (2_048, 2_000, 0.5), (4_096, 1_500, 0.8), (100, 2_000, 2.0),
    (512, 2_000, 1e-9), (2_000, 2_000, 1.05),
])
def test_distinct_ids_variance_equals_the_exact_one_with_every_pair(ids, rows, skew):
  """The rows' covariances included: every pair's ``(1 - p_j - p_k) ** ids - m_j m_k``."""
  p = zipf_probabilities(rows, skew)
  missed = np.exp(ids * np.log1p(-p))
  both = np.exp(ids * np.log1p(-np.minimum(p[:, None] + p[None, :], 1 - 1e-15)))
  pairs = both - missed[:, None] * missed[None, :]
  np.fill_diagonal(pairs, 0)
  exact = (missed * (1 - missed)).sum() + pairs.sum()
  assert cost.distinct_ids(ids, rows, skew)[1] == pytest.approx(exact, rel=1e-3)


def test_distinct_ids_matches_sampled_ids_and_falls_with_the_skew():
  """Drawn ids' distinct counts sit within the estimate's spread; more skew, fewer rows."""
  rng = np.random.default_rng(0)
  rows, ids = 20_000, 2_048
  for skew in (0.0, 0.7, 1.2):
    mean, var = cost.distinct_ids(ids, rows, skew)
    counts = [len(np.unique(rng.choice(rows, ids, p=zipf_probabilities(rows, skew))))
              for _ in range(20)]
    assert abs(np.mean(counts) - mean) < 3 * math.sqrt(var / 20) + 1, (skew, counts, mean)
    assert 0.5 * math.sqrt(var) - 1 <= np.std(counts) <= 1.5 * math.sqrt(var) + 1
  means = [cost.distinct_ids(ids, rows, s)[0] for s in (0.0, 0.5, 1.0, 1.5, 3.0)]
  assert means == sorted(means, reverse=True) and means[-1] < 50


@pytest.mark.parametrize("skew", [0.3, 0.9, 1.05, 2.0])
def test_fit_id_skew_inverts_the_estimate(skew):
  distinct = round(cost.distinct_ids(8_192, 400_000, skew)[0])
  fitted = cost.fit_id_skew(8_192, distinct, 400_000)
  assert fitted == pytest.approx(skew, abs=5e-3)
  assert cost.dedup_capacity([(8_192, 400_000, fitted)]) >= distinct


@pytest.mark.parametrize("args,match", [
    ((0, 1, 10), "need 1 <= distinct <= min"), ((10, 11, 100), "need 1 <= distinct"),
    ((10, 5, 4), "need 1 <= distinct"),
])
def test_fit_id_skew_names_a_count_that_cannot_be(args, match):
  with pytest.raises(ValueError, match=match):
    cost.fit_id_skew(*args)


def test_distinct_ids_refuses_a_negative_skew():
  with pytest.raises(ValueError, match="skew must be a finite number >= 0"):
    cost.distinct_ids(10, 100, -1.0)


def test_a_skewed_tables_update_route_is_sized_for_its_distinct_ids():
  """The sparse update routes each device's distinct ids: fewer where ids repeat."""
  from embedlib.collection import FeatureSpec, TableSpec, plan_collection
  from embedlib.plan import plan_embedding
  n, rows = 16_384, 250_000
  kw = dict(mesh={"batch": 8}, sharding="routed", ids_per_device=n)
  uniform, skewed = plan_embedding(rows, 64, **kw), plan_embedding(rows, 64, **kw, id_skew=1.05)
  assert skewed.update_capacity(n) == skewed.capacity_for(cost.dedup_capacity([(n, rows, 1.05)]))
  assert skewed.update_capacity(n) < 0.6 * uniform.update_capacity(n)
  assert skewed.sparse_update(n)[1] < 0.6 * uniform.sparse_update(n)[1]
  # A collection's table carries its skew into its plan.
  plan = plan_collection([TableSpec("t", rows, 64, sharding="routed", id_skew=1.05)],
                         [FeatureSpec("f", "t", max_ids_per_sample=16)],
                         mesh={"batch": 8}, batch_size=8192)
  assert plan["t"].plan.id_skew == 1.05
  with pytest.raises(ValueError, match="table: id_skew must be a finite number >= 0"):
    plan_embedding(rows, 64, **kw, id_skew=float("nan"))


def test_skewed_ids_size_the_node_buffer_and_can_make_two_levels_pay():
  from embedlib.plan import plan_embedding
  kw = dict(mesh={"batch": 64}, sharding="routed", devices_per_node=8, ids_per_device=8192)
  uniform = plan_embedding(10_000_000, 64, **kw)
  skewed = plan_embedding(10_000_000, 64, **kw, id_skew=1.05)
  capacity = uniform.capacity_for(8192)
  assert skewed.node_capacity_for(capacity) < 0.7 * uniform.node_capacity_for(capacity)
  assert (uniform.node_route, skewed.node_route) == (False, True)
  assert skewed.node_bytes()[1] < 0.7 * uniform.node_bytes()[1]   # bytes across nodes
