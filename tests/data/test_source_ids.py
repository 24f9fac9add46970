"""Both sources emit int32 ids inside the table for every table size, x64 on or off.

Raw ids are 64-bit hashes (Criteo's categoricals are up to 60-bit hex
values); each must be reduced into its table before it leaves the source,
never cast down and wrapped onto another row.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from embedlib.data import PAD_ID, CriteoReader, DataSpec, SparseFeature, SyntheticSource, criteo_spec
from embedlib.data.spec import MAX_ROWS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [2, 1000, 2**31 - 1, MAX_ROWS]


def _criteo_file(tmp_path, n=64):
  """Lines whose categoricals reach 60 bits: 15 hex digits, far past int32."""
  rng = np.random.default_rng(0)
  lines = []
  for i in range(n):
    cats = [format(int(v), "x") for v in rng.integers(1 << 59, 1 << 60, 26, dtype=np.int64)]
    cats[i % 26] = ""  # one missing value per line
    lines.append("\t".join([str(i % 2)] + [str(i)] * 13 + cats) + "\n")
  path = tmp_path / "day.tsv"
  path.write_text("".join(lines))
  return str(path)


def _check(ids, num_embeddings, low):
  assert ids.dtype == np.int32
  real = ids[ids != PAD_ID]
  assert real.size and real.min() >= low and real.max() < num_embeddings


@pytest.mark.parametrize("num_embeddings", SIZES)
def test_criteo_ids_are_int32_rows_of_the_table(tmp_path, num_embeddings):
  batch = next(CriteoReader(_criteo_file(tmp_path), criteo_spec(num_embeddings), batch_size=64))
  ids = np.stack(list(batch["sparse"].values()))
  _check(ids, num_embeddings, low=0)
  assert (ids == 0).sum() == 64  # the one missing value per line, and only it, is row 0
  if num_embeddings > 2**20:
    assert ids.max() > 2**20  # reduced into the table, not clipped to a small range


@pytest.mark.parametrize("num_embeddings", SIZES)
def test_synthetic_ids_are_int32_rows_of_the_table(num_embeddings):
  spec = DataSpec.from_sizes(2, [num_embeddings, num_embeddings], bag_sizes=[1, 3])
  batch = SyntheticSource(spec, batch_size=256).batch(0)
  for ids in batch["sparse"].values():
    _check(ids, num_embeddings, low=0)
  spec.check_batch(batch)


def test_a_table_past_int32_ids_is_refused_naming_the_fix():
  with pytest.raises(ValueError, match=r"'big': num_embeddings=2147483649 is more rows than "
                     r"int32 ids can address .* hash the feature into 2147483648 rows"):
    SparseFeature("big", MAX_ROWS + 1)


SCRIPT = """
import numpy as np, jax
from embedlib.data import DataSpec, SyntheticSource, to_global_batch
assert jax.config.jax_enable_x64 == {x64}
spec = DataSpec.from_sizes(1, [2**31, 50], bag_sizes=[1, 4])
batch = SyntheticSource(spec, batch_size=16).batch(3)
placed = to_global_batch(batch, jax.make_mesh((1,), ("data",)))
for name, ids in batch["sparse"].items():
  assert ids.dtype == np.int32 and placed["sparse"][name].dtype == np.int32
  np.testing.assert_array_equal(np.asarray(placed["sparse"][name]), ids)
print("ok")
"""


@pytest.mark.parametrize("x64", [False, True])
def test_ids_stay_int32_on_the_mesh_with_and_without_x64(x64):
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_X64=str(x64).lower(), PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", SCRIPT.format(x64=x64)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
