"""DataSpec / SparseFeature validation and batch checking."""

import numpy as np
import pytest

from embedlib.data import PAD_ID, DataSpec, SparseFeature


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SparseFeature("a", 0), "num_embeddings must be an int >= 1"),
        (lambda: SparseFeature("a", 10, bag_size=0), "bag_size"),
        (lambda: SparseFeature("", 10), "non-empty"),
        (lambda: DataSpec(1, (SparseFeature("a", 2), SparseFeature("a", 3))), "repeated: \\['a'\\]"),
        (lambda: DataSpec(-1, ()), "num_dense"),
        (lambda: DataSpec.from_sizes(1, [3, 4], bag_sizes=[1]), "one bag size per feature"),
    ],
)
def test_invalid_specs_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_zeros_matches_spec_and_pads_bags():
  spec = DataSpec.from_sizes(3, [5, 6], bag_sizes=[1, 4])
  batch = spec.zeros(2)
  spec.check_batch(batch, batch_size=2)
  assert (batch["sparse"]["f1"] == PAD_ID).all()
  assert batch["sparse"]["f0"].dtype == np.int32


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda b: b["sparse"].pop("f0"), "has features"),
        (lambda b: b.update(dense=b["dense"].astype(np.float64)), "float32\\[2, 3\\], got float64"),
        (lambda b: b["sparse"]["f0"].__setitem__(0, -1), "id -1 outside \\[0, 5\\)"),
        (lambda b: b["sparse"]["f1"].__setitem__((0, 0), 6), "id 6 outside"),
        (lambda b: b.pop("label"), "lacks keys \\['label'\\]"),
    ],
)
def test_check_batch_names_the_problem(corrupt, match):
  spec = DataSpec.from_sizes(3, [5, 6], bag_sizes=[1, 4])
  batch = spec.zeros(2)
  corrupt(batch)
  with pytest.raises(ValueError, match=match):
    spec.check_batch(batch)
