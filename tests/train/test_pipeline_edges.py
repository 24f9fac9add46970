"""The pipelined step on the batches users feed it: the in-line step bit for bit.

``test_pipeline.py`` checks the pipelined step on int32 ids of full, random
batches. Here the same comparison (losses and every final variable, over a
few steps) runs on what else reaches it: ids of every integer dtype, x64
off and on, with negative and out-of-range ones (past int32 too); degenerate
batches (every id the same, distinct ids all on one owner past the route
capacity, every id padding); features with no ids; and a batch of another
shape than the one before (the last, smaller batch of an epoch).

One small model holds each lookup that distributes ids ahead: a routed
table (unpooled, with a route capacity one owner's ids overflow), a vocab
table (unpooled and as bags) and a collection deduplicating a routed and a
vocab table with a capacity random batches overflow (the fallback). It
looks up only the features a batch has, so a test compiles what it needs.
Batches of one shape and dtype share their programs, so the degenerate
batches run as the steps of one run. CI covers each dtype and each
degenerate batch once, with and without early fetch; ``-m slow`` runs every
dtype on every feature, x64 off and on, both ways.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import embedlib
from embedlib import data as data_lib
from embedlib.strategies import request, rowmap, sharded
from embedlib.training import pipeline, steps
from tests.train.pipeline_runs import leaves, placed
from tests.train.test_pipeline import CTR, MESH, RULE, TX, _check_same

B = 16
ROUTED, VOCAB, ITEM, CAT = 50, 30, 60, 20
# feature: (table rows, width: () for one id per sample, else the bag's)
FEATURES = {"r": (ROUTED, (2,)), "v": (VOCAB, (3,)), "w": (VOCAB, (2,)),
            "clicks": (ITEM, (3,)), "cat": (CAT, (2,))}


class Model(nnx.Module):
  """Every lookup that moves ids before rows; small capacities, so batches overflow them."""

  def __init__(self, rngs):
    self.routed = embedlib.ShardedEmbed(ROUTED, 4, mesh=MESH, sharding="routed",
                                        route_capacity=2, rngs=rngs)
    self.vocab = embedlib.ShardedEmbed(VOCAB, 4, mesh=MESH, sharding="vocab", rngs=rngs)
    self.coll = embedlib.EmbeddingCollection(
        [embedlib.TableSpec("item", ITEM, 4, sharding="routed"),
         embedlib.TableSpec("cat", CAT, 4, sharding="vocab")],
        [embedlib.FeatureSpec("clicks", "item", combiner="mean"),
         embedlib.FeatureSpec("cat", "cat", combiner="sum")],
        mesh=MESH, num_unique=4, replicate_below_bytes=0, rngs=rngs)
    self.out = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, dense, sparse):
    """The features the batch has (the collection's together): a test compiles what it needs."""
    x = []
    if "r" in sparse:
      x.append(self.routed(sparse["r"]).sum(1))
    if "v" in sparse:
      x.append(self.vocab(sparse["v"]).sum(1))
    if "w" in sparse:
      x.append(self.vocab.bag(sparse["w"], combiner="mean"))
    if "clicks" in sparse:
      c = self.coll({"clicks": sparse["clicks"], "cat": sparse["cat"]})
      x += [c["clicks"], c["cat"]]
    return self.out(sum(x))[:, 0] + dense[:, 0]


def _make():
  return placed(Model(nnx.Rngs(0)), TX, RULE, MESH)


def _kept(dtype):
  """The values of ``dtype`` a batch may hold: with x64 off, 32 bits' worth.

  ``to_global_batch`` refuses 64-bit values jax would wrap (``test_prefetch``).
  """
  if np.dtype(dtype).itemsize == 8 and not jax.config.jax_enable_x64:
    return np.iinfo(np.int32 if np.dtype(dtype).kind == "i" else np.uint32)
  return np.iinfo(dtype)


def _random_ids(rng, rows, shape, dtype):
  """Ids in and out of ``[0, rows)`` (negative ones too), as far as ``dtype`` holds them."""
  info = _kept(dtype)
  ids = rng.integers(max(-3, info.min), min(rows + 3, info.max) + 1, shape)
  if info.max > rows + 3:  # some far past the table: past int32 where the dtype holds it
    ids = np.where(rng.random(shape) < 0.1, min(info.max, 2**32 + 5), ids)
  return ids.astype(dtype)


def _batch(seed, sparse=None, dtypes=None, features=None, batch=B):
  """A global batch of ``features``: ``sparse``'s ids, random ids of ``dtypes`` for the rest."""
  rng = np.random.default_rng(seed)
  features = features or list(FEATURES)
  ids = {k: _random_ids(rng, FEATURES[k][0], (batch,) + FEATURES[k][1],
                        (dtypes or {}).get(k, np.int32)) for k in features}
  ids.update(sparse or {})
  return data_lib.to_global_batch(
      {"dense": rng.normal(size=(batch, 1)).astype(np.float32),
       "label": (rng.random(batch) < 0.5).astype(np.float32), "sparse": ids}, MESH)


class Batches:
  """A list of batches with a resumable position."""

  def __init__(self, batches):
    self.batches, self.position = batches, 0

  def __iter__(self):
    return self

  def __next__(self):
    if self.position >= len(self.batches):
      raise StopIteration
    self.position += 1
    return self.batches[self.position - 1]

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = state["position"]


def _in_line(batches):
  model, optimizer = _make()
  losses = [float(steps.train_step(model, optimizer, b, task=CTR)) for b in batches]
  return losses, leaves(model, optimizer)


def _pipelined(batches, early_fetch):
  model, optimizer = _make()
  runner = pipeline.Pipeline(model, optimizer, Batches(batches), CTR, early_fetch=early_fetch)
  losses = [float(runner.step()) for _ in batches]
  with pytest.raises(StopIteration):
    runner.step()
  return losses, leaves(model, optimizer)


def _check(batches, early_fetch=(0.0,)):
  """Pipelined runs (one per ``early_fetch``) == the in-line run on ``batches``."""
  want = _in_line(batches)
  for value in early_fetch:
    _check_same(want, _pipelined(batches, value))


def _on_one_owner(embed, n):
  """``n`` distinct ids of ``embed``'s table whose rows its first rank holds."""
  plan = embed.plan
  logical = np.arange(plan.num_embeddings, dtype=np.int32)
  physical = np.asarray(rowmap.physical_ids(jnp.asarray(logical), plan))
  mine = logical[physical // (plan.padded_shape[0] // plan.group_size) == 0]
  assert len(mine) >= n, (plan.name, mine)
  return mine[:n]


def _degenerate(dtypes):
  """Batches of ``dtypes``' features: random ids; every id the same; one owner; all padding."""
  model = Model(nnx.Rngs(0))
  tables = {"r": model.routed, "v": model.vocab, "w": model.vocab,
            "clicks": model.coll.tables["item"], "cat": model.coll.tables["cat"]}
  shape = lambda k: (B,) + FEATURES[k][1]
  # Distinct ids on one owner, 4 per device: past the routed table's capacity.
  local = (request.Request(jnp.zeros(shape("r"), jnp.int32)),)
  assert sharded.route_capacity(local, model.routed.plan) < 4
  invalid = lambda d: -1 if np.iinfo(d).min < 0 else _kept(d).max
  kinds = [
      {},
      {k: np.full(shape(k), 5, d) for k, d in dtypes.items()},
      {k: np.resize(_on_one_owner(tables[k], 3), shape(k)).astype(d) for k, d in dtypes.items()},
      {k: np.full(shape(k), invalid(d), d) for k, d in dtypes.items()},
  ]
  return [_batch(i, sparse, dtypes, features=list(dtypes))
          for i, sparse in enumerate(kinds, start=1)]


# -- CI: each dtype and each degenerate batch once -----------------------------------


NARROW = {"r": np.uint8, "w": np.uint16, "clicks": np.uint32, "cat": np.int16}


def test_narrow_ids_on_degenerate_batches():
  """x64 off: uint8, uint16, uint32 and int16 ids; random, duplicated, one owner, padding."""
  _check(_degenerate(NARROW))


def test_wide_ids_on_degenerate_batches_with_early_fetch():
  """x64 on: int64 (past int32 too), uint64 and int8 ids, the rows fetched early."""
  dtypes = {"r": np.int64, "clicks": np.uint64, "cat": np.int8}
  with jax.enable_x64(True):
    batches = _degenerate(dtypes)
    for k, d in dtypes.items():
      assert batches[0]["sparse"][k].dtype == d, k
    _check(batches, early_fetch=(0.5,))


def test_a_smaller_last_batch_whose_features_have_no_ids():
  """The next batch of other shapes: another program (compiled once), not an error.

  Each step's program distributes the next batch as that batch's shapes
  ask (the first program here is the narrow test's); lookups of no ids stay
  in line.
  """
  empty = {k: np.zeros((B // 2, 0), d) for k, d in NARROW.items() if k != "cat"}
  _check([_batch(1, dtypes=NARROW, features=list(NARROW)),
          _batch(2, empty, NARROW, features=list(NARROW), batch=B // 2)])


# -- slow: every dtype on every feature --------------------------------------------

DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


@pytest.mark.slow
@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_on_every_feature(dtype, x64):
  """64-bit ids with x64 off reach the step as int32 (``to_global_batch``), in line too.

  With x64 off their values stay within 32 bits: past that ``to_global_batch``
  refuses them (``tests/data/test_prefetch.py``).
  """
  with jax.enable_x64(x64):
    _check(_degenerate({k: dtype for k in FEATURES}), early_fetch=(0.0, 0.5))


@pytest.mark.slow
def test_a_change_of_shape_with_early_fetch():
  empty = {k: np.zeros((B, 0), np.int32) for k in ("r", "v", "w", "clicks")}
  _check([_batch(1), _batch(2, empty), _batch(3), _batch(4, batch=B // 2)],
         early_fetch=(0.5,))
