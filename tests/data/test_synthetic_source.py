"""SyntheticSource: determinism, process slices, resumption, the planted model."""

import numpy as np
import pytest

from embedlib.data import PAD_ID, DataSpec, SyntheticSource
from embedlib.metrics import auc

SPECS = {
    "single": DataSpec.from_sizes(3, [50, 7, 1000]),
    "multi": DataSpec.from_sizes(2, [40, 30, 20], bag_sizes=[1, 1, 4]),
}


def assert_batches_equal(a, b):
  np.testing.assert_array_equal(a["dense"], b["dense"])
  np.testing.assert_array_equal(a["label"], b["label"])
  assert a["sparse"].keys() == b["sparse"].keys()
  for name in a["sparse"]:
    np.testing.assert_array_equal(a["sparse"][name], b["sparse"][name])


def concat(batches):
  return {
      "dense": np.concatenate([b["dense"] for b in batches]),
      "label": np.concatenate([b["label"] for b in batches]),
      "sparse": {k: np.concatenate([b["sparse"][k] for b in batches]) for k in batches[0]["sparse"]},
  }


@pytest.mark.parametrize("spec_name", SPECS)
def test_batches_follow_the_spec(spec_name):
  spec = SPECS[spec_name]
  for batch in SyntheticSource(spec, batch_size=64, num_batches=3):
    spec.check_batch(batch, batch_size=64)
  bag = SyntheticSource(SPECS["multi"], batch_size=256).batch(0)["sparse"]["f2"]
  present = bag != PAD_ID
  assert present[:, 0].all()  # every bag has at least one id ...
  assert (np.diff(present.astype(int), axis=1) <= 0).all()  # ... and is padded on the right
  assert set(present.sum(axis=1)) == {1, 2, 3, 4}


def test_same_seed_same_stream_other_seed_or_split_differs():
  spec = SPECS["single"]
  first = SyntheticSource(spec, batch_size=32, seed=3).batch(5)
  assert_batches_equal(first, SyntheticSource(spec, batch_size=32, seed=3).batch(5))
  others = (
      SyntheticSource(spec, batch_size=32, seed=4),
      SyntheticSource(spec, batch_size=32, seed=3, split="eval"),
  )
  for other in others:
    assert not np.array_equal(first["dense"], other.batch(5)["dense"])


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_reassemble_the_one_process_batches(spec_name, process_count):
  spec = SPECS[spec_name]
  whole = SyntheticSource(spec, batch_size=16)
  parts = [
      SyntheticSource(spec, batch_size=16, process_index=p, process_count=process_count)
      for p in range(process_count)
  ]
  for _ in range(3):
    local = [next(p) for p in parts]
    assert all(b["label"].shape == (16 // process_count,) for b in local)
    assert_batches_equal(concat(local), next(whole))


def test_resume_from_state_continues_with_the_same_batches():
  spec = SPECS["multi"]
  src = SyntheticSource(spec, batch_size=8)
  for _ in range(4):
    next(src)
  state = src.get_state()
  expected = [next(src) for _ in range(3)]
  resumed = SyntheticSource(spec, batch_size=8)
  resumed.set_state(state)
  assert state == {"position": 4}
  for batch in expected:
    assert_batches_equal(batch, next(resumed))


def test_num_batches_bounds_the_stream():
  src = SyntheticSource(SPECS["single"], batch_size=4, num_batches=3)
  assert len(src) == 3 and len(list(src)) == 3
  with pytest.raises(TypeError, match="endless"):
    len(SyntheticSource(SPECS["single"], batch_size=4))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=10, process_count=4), "multiple of process_count=4"),
        (dict(batch_size=8, process_index=2, process_count=2), "process_index=2"),
        (dict(batch_size=8, zipf_exponent=0), "zipf_exponent"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SyntheticSource(SPECS["single"], **kwargs)


def head_share(zipf_exponent):
  """Share of examples on the 10 most frequent rows of a 1000-row table."""
  spec = DataSpec.from_sizes(0, [1000])
  ids = SyntheticSource(spec, batch_size=20_000, zipf_exponent=zipf_exponent).batch(0)["sparse"]["f0"]
  counts = np.sort(np.bincount(ids, minlength=1000))[::-1]
  return counts[:10].sum() / counts.sum()


def test_popularity_is_skewed_and_grows_with_the_exponent():
  low, high = head_share(1.05), head_share(1.2)
  assert 0.1 < low < high  # uniform rows would give 0.01


def test_labels_follow_the_planted_probabilities():
  spec = DataSpec.from_sizes(8, [1000] * 8)
  src = SyntheticSource(spec, batch_size=20_000)
  batch, logits = src._generate(0, 20_000)
  probs = 1 / (1 + np.exp(-logits))
  # Calibration: the click rate matches the mean probability, overall and
  # within the top and bottom halves of the oracle's scores.
  for rows in (slice(None), probs > np.median(probs), probs <= np.median(probs)):
    assert batch["label"][rows].mean() == pytest.approx(probs[rows].mean(), abs=0.015)
  assert auc(batch["label"], logits) == pytest.approx(src.oracle_auc(1), abs=1e-12)


def test_default_oracle_auc_is_learnable_but_not_trivial():
  spec = DataSpec.from_sizes(8, [1000] * 8)
  m = SyntheticSource(spec, batch_size=4096, split="eval", num_batches=4).oracle_metrics()
  assert 0.75 < m["auc"] < 0.85 and m["count"] == 16384
  flat = SyntheticSource(spec, batch_size=4096, signal_scale=0.0).oracle_metrics(1)
  assert flat["auc"] == 0.5  # constant logits: every pair is a tie


def test_tabulated_and_hashed_row_weights_give_identical_batches(monkeypatch):
  from embedlib.data import synthetic

  spec = SPECS["multi"]
  tabulated = SyntheticSource(spec, batch_size=64)
  monkeypatch.setattr(synthetic, "_TABULATE_ROWS", 0)
  hashed = SyntheticSource(spec, batch_size=64)
  assert all(t is None for t in hashed._weight_tables)
  assert all(t is not None for t in tabulated._weight_tables)
  (a, logits_a), (b, logits_b) = tabulated._generate(0, 64), hashed._generate(0, 64)
  assert_batches_equal(a, b)
  np.testing.assert_array_equal(logits_a, logits_b)
