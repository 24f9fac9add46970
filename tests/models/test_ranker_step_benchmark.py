"""benchmarks/ranker_step.py compares like with like: both versions of the ranker give one loss."""

import pytest

from tests import benchmark_scripts


@pytest.mark.slow
def test_embedlib_and_nnx_embed_rankers_start_from_the_same_loss(capsys):
  ranker_step = benchmark_scripts.load("ranker_step")
  assert ranker_step.check(vocab=1000)
  assert "equal" in capsys.readouterr().out
