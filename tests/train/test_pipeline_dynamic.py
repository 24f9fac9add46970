"""The pipelined step with dynamic tables: the in-line run, bit for bit, across a resume.

A map runs a step ahead of the rows it places (``embedlib.lookahead``), so
what can go wrong is order: a row evicted and placed for batch N+1 must be
reset after step N's update (with its optimizer slots), the checkpoint
after step N must hold batch N's map (not N+1's), and a resumed run must
step its first map from the restored one. Tables far smaller than the ids
seen make every step admit and evict: an LFU table with admission after
two sightings and a learned default row, shared by two features of a
collection (one step of its map), its ids routed to the map's owners.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import dynamic
from embedlib import data as data_lib
from embedlib.training import steps
from tests.train.pipeline_runs import Numbered, leaves, placed, resumed_halfway
from tests.train.test_pipeline import CTR, MESH, RULE, TX

B = 16
STEPS = 6
#: Raw ids, past 2**32 too: 96 distinct ones for tables of 32 rows.
POOL = np.array([i * 7919 + (i % 3) * 2**40 for i in range(96)], np.int64)


class Model(nnx.Module):
  def __init__(self, rngs):
    self.coll = embedlib.EmbeddingCollection(
        [embedlib.TableSpec("item", 32, 4, dynamic=embedlib.DynamicSpec(
            bucket_size=4, eviction="lfu", admit_after=2, decay_every=2, default="learned"))],
        [embedlib.FeatureSpec("clicks", "item", combiner="mean"),
         embedlib.FeatureSpec("last", "item", max_ids_per_sample=1)],
        mesh=MESH, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, dense, sparse):
    c = self.coll({"clicks": sparse["clicks"], "last": sparse["last"]})
    return self.out(jnp.concatenate([c["clicks"], c["last"]], -1))[:, 0] + dense[:, 0]


def _batch(i):
  r = np.random.default_rng(i)
  clicks = r.choice(POOL, (B, 3))
  clicks[r.random((B, 3)) < 0.2] = -1                       # padding in the bags
  sparse = {"clicks": clicks, "last": r.choice(POOL[:48], B)}
  batch = {"dense": r.normal(size=(B, 1)).astype(np.float32),
           "label": (r.random(B) < 0.5).astype(np.float32),
           "sparse": {k: dynamic.words(v) for k, v in sparse.items()}}
  return data_lib.to_global_batch(batch, MESH)


def _make():
  return placed(Model(nnx.Rngs(0)), TX, RULE, MESH)


def _tables(model):
  return [model.coll.dynamic["item"]]


@pytest.fixture(scope="module")
def in_line():
  model, optimizer = _make()
  losses, evicted = [], [0]
  for i in range(STEPS):
    losses.append(float(steps.train_step(model, optimizer, _batch(i + 1), task=CTR)))
    for t, table in enumerate(_tables(model)):
      evicted[t] += table.stats()["evicted"]
  return losses, leaves(model, optimizer), [t.resident() for t in _tables(model)], evicted


@pytest.mark.parametrize("early_fetch", [
    0.0, pytest.param(0.25, marks=pytest.mark.slow)], ids=["ids", "early_fetch"])
def test_pipelined_dynamic_tables_equal_in_line_across_a_resume(in_line, tmp_path, early_fetch):
  """Under early fetch, a placed row's reset is one of the changes corrected."""
  want_losses, want, want_maps, evicted = in_line
  assert all(e > 0 for e in evicted), evicted      # evicted rows were reset

  def holds_batch_halfs_maps(model):  # not the one read ahead
    assert all(int(t.clock[...]) == STEPS // 2 for t in _tables(model))

  losses, model, optimizer = resumed_halfway(
      _make, lambda steps: Numbered(steps, _batch), CTR, STEPS, tmp_path,
      early_fetch=early_fetch, check_restored=holds_batch_halfs_maps)
  assert losses == want_losses                       # bit for bit, every step
  assert [t.resident() for t in _tables(model)] == want_maps
  got = leaves(model, optimizer)
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
