"""The seed systems' scenarios, by name: each one they reject works here."""

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from tests import xla_env
from tests.embed.contract import build, check_contract, make_mesh, random_case

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_async_emb_width_100_over_8_ranks():
  """Seed 000 rejects emb_width=100 over an 8-rank group; here it pads to 104."""
  mesh = make_mesh((8,), ("batch",))
  emb = build(1000, 100, mesh, sharding="hidden")
  assert emb.plan.padded_shape == (1000, 104)
  assert emb.plan.token_axes == ("batch",)
  ids, query = random_case(1000, 100, batch=16)
  check_contract(emb, ids, query)


def test_async_emb_tokens_not_divisible_by_group():
  """Seed 000 rejects tokens_per_batch % group != 0; 13 tokens over 8 work."""
  mesh = make_mesh((8,), ("batch",))
  for strategy in ("hidden", "vocab"):
    emb = build(96, 64, mesh, sharding=strategy)
    ids, query = random_case(96, 64, batch=13)
    check_contract(emb, ids, query)


def test_async_emb_replica_axis_outside_group_2x4():
  """Seed 001's rejected mesh, at 8 devices: replica axis outside the group."""
  mesh = make_mesh((2, 4), ("replica", "batch"))
  for strategy in ("hidden", "vocab"):
    emb = build(300, 100, mesh, sharding=strategy, table_axes=("batch",),
                data_axes=("replica", "batch"))
    assert emb.plan.token_axes == ("batch",)
    ids, query = random_case(300, 100, batch=10)
    check_contract(emb, ids, query)


def test_tensor_parallel_vocab_sizes_that_do_not_divide():
  """Seed 004: GPT-2 (50257), Whisper (51865) and a test vocab of 99 over 8."""
  mesh = make_mesh((2, 4), ("data", "model"))
  for vocab in (50257, 51865, 99):
    emb = build(vocab, 8, mesh, tied=True, replicate_below_bytes=0)
    assert emb.plan.strategy == "vocab"  # embedding_rowwise, shared with lm_head
    ids, query = random_case(vocab, 8, batch=6)
    check_contract(emb, ids, query)


def test_tensor_parallel_colwise_uneven_width():
  """Seed 004's embedding_colwise with a width that doesn't divide 4 ranks."""
  mesh = make_mesh((4,), ("model",))
  emb = build(64, 30, mesh, sharding="hidden")
  assert emb.plan.shard_shape == (64, 8)
  ids, query = random_case(64, 30, batch=5)
  check_contract(emb, ids, query)


@pytest.mark.slow
def test_sixteen_devices_in_subprocess():
  """The exact rejected mesh {'replica': 2, 'batch': 8} needs 16 devices."""
  script = textwrap.dedent("""
      import jax
      from tests.embed.contract import build, check_contract, make_mesh, random_case
      assert len(jax.devices()) == 16
      mesh = make_mesh((2, 8), ("replica", "batch"))
      for strategy in ("hidden", "vocab", "replicated"):
        emb = build(1000, 100, mesh, sharding=strategy, table_axes=("batch",),
                    data_axes=("replica", "batch"))
        check_contract(emb, *random_case(1000, 100, batch=21))
      for strategy in ("hidden", "vocab"):
        emb = build(50257, 3, make_mesh((16,), ("batch",)), sharding=strategy)
        check_contract(emb, *random_case(50257, 3, batch=18))
      print("16 devices ok")
  """)
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                          env=xla_env.subprocess_env(16),
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "16 devices ok" in result.stdout
