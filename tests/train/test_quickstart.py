"""The full quickstart config reaches the planted oracle's AUC (within 0.02).

The one test that trains to convergence: about a minute on 2 CPU cores.
"""

import pytest

from configs import quickstart
from embedlib.training import train_lib
from embedlib.training.writers import read_jsonl


@pytest.mark.slow
def test_quickstart_reaches_the_oracle_auc(tmp_path):
  result = train_lib.train_and_evaluate(quickstart.get_config(), str(tmp_path))
  assert result["step"] == 1200
  assert train_lib.oracle_gap(result) < 0.02, result
  aucs = [r["auc"] for r in read_jsonl(tmp_path / "eval.jsonl")]
  assert aucs == sorted(aucs)  # it keeps learning: every eval beats the last
