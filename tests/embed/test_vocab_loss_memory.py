"""The vocab-parallel loss step never holds a token's whole row of logits.

Issue 14's figure, at its size: vocab 262144, 8192 tokens, 8 devices
(tensor parallel). ``benchmarks/vocab_loss_memory.py`` compiles one
``value_and_grad`` step through ``attend`` two ways from abstract inputs
(never run, nothing allocated) and reads each one's temporary bytes per
device from XLA's memory analysis. The vocab-parallel step must need at most
1/4 of the dense step's (all logits concatenated, then optax), and less than
one copy of all the logits; the dense step holds at least that copy, which
shows the check can fail.
"""

import importlib.util
import pathlib
import sys

import jax.numpy as jnp
import pytest

from tests import benchmark_scripts

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "vocab_loss_memory.py"
VOCAB, TOKENS, FEATURES = 262_144, 8192, 1024


def import_script():
  """Imports the benchmark by path, leaving ``sys.path`` as it was."""
  saved = list(sys.path)
  try:
    spec = importlib.util.spec_from_file_location("vocab_loss_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path[:] = saved
  return module


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vocab_parallel_step_needs_a_quarter_of_the_dense_temporaries(dtype):
  measured = import_script().temp_bytes(VOCAB, TOKENS, FEATURES, devices=8, dtype=dtype)
  all_logits = TOKENS * VOCAB * jnp.dtype(dtype).itemsize
  assert measured["dense"] >= all_logits
  assert measured["vocab-parallel"] < all_logits
  assert measured["vocab-parallel"] <= measured["dense"] / 4


def test_script_prints_both_paths(capsys, tmp_path):
  path = tmp_path / "run.json"
  assert import_script().main(["--vocab", "4099", "--tokens", "64", "--features", "32",
                               "--json", str(path)]) == 0
  out = capsys.readouterr().out
  assert "dense" in out and "vocab-parallel" in out and "ratio" in out
  record = benchmark_scripts.read_record(path, ["vocab_parallel_over_dense"])
  assert record["ratios"]["vocab_parallel_over_dense"] < 1
