"""The pipelined train step: the same training as the in-line step, bit for bit.

One model holds every lookup that distributes ids ahead: a routed table
across two nodes (the two-level route), a vocab table looked up as pooled
bags, and a collection deduplicating a routed table (its distinct ids
routed, flat) and a vocab table (its distinct ids gathered). The in-line
run is compiled once per module; the pipelined run checkpoints in the middle
and resumes from the checkpoint on a fresh model, whose first step
recomputes the distribution from the restored data position.
CI runs ``STEPS`` steps; ``-m slow`` runs 50. Under early fetch the
collection's tables fetch their distinct ids' rows a step early (the vocab
table's over its token axes); the pooled vocab bags are read in line. A
tensor-parallel vocab table (rest axes) is checked on its own.

The structure test reads the compiled pipelined step's HLO: the collectives
that exchange the next batch's ids depend on the next batch's parameters
alone, nothing of the model, the optimizer or this step's batch.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import embedlib
from embedlib import optim
from embedlib import data as data_lib
from embedlib.plan import hlo
from embedlib.training import pipeline, setup, steps
from embedlib.training.tasks import CTRTask
from tests.train.pipeline_runs import Numbered, leaves, placed, resumed_halfway

B = 32
STEPS = 6
MESH = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))


class Model(nnx.Module):
  """A click model over every layout whose lookups move ids before rows."""

  def __init__(self, rngs, collection=True):
    # Two nodes of 4 (the two-level route); the collection's routed table is flat.
    self.routed = embedlib.ShardedEmbed(50, 4, mesh=MESH, sharding="routed",
                                        devices_per_node=4, rngs=rngs)
    self.vocab = embedlib.ShardedEmbed(30, 4, mesh=MESH, sharding="vocab", rngs=rngs)
    self.coll = embedlib.EmbeddingCollection(
        [embedlib.TableSpec("item", 60, 4, sharding="routed"),
         embedlib.TableSpec("cat", 20, 4, sharding="vocab")],
        [embedlib.FeatureSpec("clicks", "item", combiner="mean"),
         embedlib.FeatureSpec("last", "item", max_ids_per_sample=1),
         embedlib.FeatureSpec("cat", "cat", combiner="sum")],
        mesh=MESH, num_unique=16, replicate_below_bytes=0, rngs=rngs) if collection else None
    self.out = nnx.Linear(20 if collection else 8, 1, rngs=rngs)

  def __call__(self, dense, sparse):
    x = [self.routed(sparse["r"]).sum(1), self.vocab.bag(sparse["v"], combiner="sum")]
    if self.coll is not None:
      c = self.coll({k: sparse[k] for k in ("clicks", "last", "cat")})
      x += [c["clicks"], c["last"], c["cat"]]
    return self.out(jnp.concatenate(x, -1))[:, 0] + dense[:, 0]


def _batch(i, collection=True):
  r = np.random.default_rng(i)
  sparse = {"r": r.integers(-1, 50, (B, 2)), "v": r.integers(-1, 30, (B, 3))}
  if collection:
    sparse.update(clicks=r.integers(-1, 60, (B, 3)), last=r.integers(0, 60, (B,)),
                  cat=r.integers(-1, 20, (B, 2)))
  batch = {"dense": r.normal(size=(B, 1)).astype(np.float32),
           "label": (r.random(B) < 0.5).astype(np.float32),
           "sparse": {k: v.astype(np.int32) for k, v in sparse.items()}}
  return data_lib.to_global_batch(batch, MESH)


def _source(steps, collection=True):
  return Numbered(steps, lambda i: _batch(i, collection))


# Shared: the optimizer keeps them as static attributes, so fresh ones
# would make each new optimizer another jit cache key (another compile).
TX, RULE = optax.adam(0.01), optim.RowWiseAdagrad(0.1)
#: The task of a click model called as ``model(dense, sparse)``.
CTR = CTRTask()


def _make(collection=True):
  return placed(Model(nnx.Rngs(0), collection), TX, RULE, MESH)


@pytest.fixture(scope="module")
def in_line():
  """``steps``-step in-line runs: losses and the final model and optimizer, by step count."""
  runs = {}

  def run(num_steps):
    if num_steps not in runs:
      model, optimizer = _make()
      losses = [float(steps.train_step(model, optimizer, _batch(i + 1), task=CTR))
                for i in range(num_steps)]
      runs[num_steps] = losses, leaves(model, optimizer)
    return runs[num_steps]

  return run


def _pipelined_with_resume(num_steps, tmp_path, early_fetch=0.0):
  """The pipelined run, checkpointed after half its steps and resumed on a fresh model."""
  losses, model, optimizer = resumed_halfway(_make, _source, CTR, num_steps, tmp_path,
                                             early_fetch=early_fetch)
  return losses, leaves(model, optimizer)


def _check_same(in_line_run, pipelined_run):
  (want_losses, want), (losses, got) = in_line_run, pipelined_run
  assert losses == want_losses  # bit for bit, every step
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


def test_pipelined_run_equals_in_line_across_a_resume(in_line, tmp_path):
  _check_same(in_line(STEPS), _pipelined_with_resume(STEPS, tmp_path))


@pytest.mark.slow
def test_fifty_pipelined_steps_equal_in_line_across_a_resume(in_line, tmp_path):
  _check_same(in_line(50), _pipelined_with_resume(50, tmp_path))


def test_early_fetch_equals_in_line_across_a_resume(in_line, tmp_path):
  _check_same(in_line(STEPS), _pipelined_with_resume(STEPS, tmp_path, early_fetch=0.25))


@pytest.mark.slow
@pytest.mark.parametrize("early_fetch", [1.0, 0.01], ids=["corrections", "refetch"])
def test_fifty_early_fetch_steps_equal_in_line_across_a_resume(in_line, tmp_path, early_fetch):
  """Room for every changed row, and for one (nearly every step sends its rows again)."""
  _check_same(in_line(50), _pipelined_with_resume(50, tmp_path, early_fetch))


@pytest.mark.slow
def test_rows_fetched_early_are_stale_without_their_correction(in_line, monkeypatch):
  """What the correction is for: TorchRec's semi-sync pipeline trains on these."""
  from embedlib.strategies import routed, vocab  # pylint: disable=g-import-not-at-top

  monkeypatch.setattr(routed, "rows_up_to_date", lambda table, got, c, **_: got["rows"])
  monkeypatch.setattr(vocab, "rows_up_to_date", lambda table, got, c, **_: got["rows"])
  want_losses, _ = in_line(STEPS)
  model, optimizer = _make()
  runner = pipeline.Pipeline(model, optimizer, _source(STEPS), CTR, early_fetch=0.5)
  losses = [float(runner.step()) for _ in range(STEPS)]
  assert losses[0] == want_losses[0] and losses[1:] != want_losses[1:]


@pytest.mark.parametrize("table_axes", [("data", "model"), ("model",)],
                         ids=["token_and_rest_axes", "rest_axes_only"])
def test_vocab_rows_fetched_early_are_brought_up_to_date_exactly(table_axes):
  """A tensor-parallel vocab table (rest axes), the layout the model above lacks.

  Rows fetched from one table, then looked up from a table with a few rows
  changed (corrected, one of them to -0.0, which comes out 0.0 in line)
  and with many (every row sent again): the in-line lookup bit for bit.
  """
  from embedlib.strategies import dispatch, request  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  embed = embedlib.ShardedEmbed(30, 4, mesh=mesh, sharding="vocab", table_axes=table_axes,
                                data_axes=("data",), rngs=nnx.Rngs(0))
  assert embed.plan.rest_axes == ("model",)
  table = embed.physical_table()
  ids = jnp.asarray(np.random.default_rng(0).integers(-1, 30, (16, 2)), jnp.int32)
  run = dict(plan=embed.plan, mesh=mesh, gather=embedlib.kernels.gather,
             bag=embedlib.kernels.bag)
  requests = (request.Request(ids),)

  @jax.jit
  def in_line_and_early(table, updated):
    early = dispatch.distribute(requests, plan=embed.plan, mesh=mesh, table=table,
                                gather=run["gather"], early_fetch=0.25)
    return (dispatch.lookup_requests(updated, requests, **run)[0][0],
            dispatch.finish(updated, requests, early, **run)[0][0])

  marked = jnp.array([-0.0, 1.0, 2.0, 3.0])
  few = table.at[4].set(marked).at[7].add(1.0)
  for updated in (few, table + 1.0):
    want, got = in_line_and_early(table, updated)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
  want, _ = in_line_and_early(table, few)
  marked_rows = np.asarray(want)[np.all(np.asarray(want) == marked, axis=-1)]
  assert len(marked_rows) and not np.signbit(marked_rows).any()


def test_the_step_reads_the_distribution_it_is_handed(in_line):
  """Another batch's distribution gives another loss: the step doesn't redo its own."""
  want_losses, _ = in_line(STEPS)
  model, optimizer = _make()
  runner = pipeline.Pipeline(model, optimizer, _source(STEPS), CTR)
  # pylint: disable-next=protected-access
  runner._distributed = pipeline.distribute_batch(model, _batch(2), task=CTR)
  assert float(runner.step()) != want_losses[0]


def test_a_source_without_a_position_is_refused_naming_the_fix():
  with pytest.raises(pipeline.LookaheadError,
                     match=r"list_iterator has no get_state\(\) or set_state\(\).*"
                           r"config.pipeline=False"):
    pipeline.Pipeline(None, None, iter([{"dense": 0}]), CTR)


def test_early_fetch_without_the_pipeline_is_refused_naming_the_fix():
  from configs import quickstart  # pylint: disable=g-import-not-at-top

  config = quickstart.get_config("smoke")
  with config.unlocked():
    config.early_fetch = 0.5
  with pytest.raises(setup.ConfigError, match=r"early_fetch.*set pipeline=True with it"):
    setup.validate(config)


# -- structure: the next batch's id exchange in the compiled step ---------------

_PARAMETER_NAME = re.compile(r'parameter\(\d+\).*op_name="(?P<arg>[^"]*)"')
_EXCHANGES = ("all-to-all", "all-gather")


def _entry(text):
  """The entry computation: instruction name -> its line."""
  return dict(hlo.entry_instructions(text))


def _parameters_feeding(lines, name):
  """The entry parameters (their argument paths) ``name`` transitively reads."""
  found, todo, seen = set(), [name], set()
  while todo:
    current = todo.pop()
    if current in seen:
      continue
    seen.add(current)
    rest = lines[current]
    parameter = _PARAMETER_NAME.search(rest)
    if parameter:
      found.add(parameter.group("arg").replace("\\", ""))
    todo += [o for o in re.findall(r"%([\w.\-]+)", rest) if o in lines]
  return found


def _exchanges(lines):
  return {n: r for n, r in lines.items()
          if re.search(r"\s(" + "|".join(_EXCHANGES) + r")(-start)?\(", r)}


def test_the_next_batch_id_exchange_depends_on_the_next_batch_alone():
  model, optimizer = _make(collection=False)
  batch, following = _batch(1, False), _batch(2, False)
  distributed = pipeline.distribute_batch(model, batch, task=CTR)
  text = pipeline.pipelined_train_step.lower(
      model, optimizer, batch, distributed, following, task=CTR).compile().as_text()
  lines = _entry(text)
  feeding = {n: _parameters_feeding(lines, n) for n in _exchanges(lines)}
  ahead = {n: p for n, p in feeding.items() if any(a.startswith("next_batch") for a in p)}
  kinds = {re.search(r"\s(" + "|".join(_EXCHANGES) + r")", lines[n]).group(1) for n in ahead}
  # The routed table's ids go out by all-to-all, the vocab table's are gathered.
  assert kinds == {"all-to-all", "all-gather"}, feeding
  for name, args in ahead.items():
    assert all(a.startswith("next_batch['sparse']") for a in args), (name, args)
  # This step's lookups move no ids: they read what the previous step distributed.
  for name, args in feeding.items():
    assert not any(a.startswith("batch['sparse']") for a in args), (name, args)


# -- the train loop: config.pipeline ---------------------------------------------


@pytest.mark.slow
def test_train_loop_pipelined_equals_in_line_across_a_resume(tmp_path):
  from configs import quickstart  # pylint: disable=g-import-not-at-top
  from embedlib.training import train_lib  # pylint: disable=g-import-not-at-top
  from embedlib.training.writers import read_jsonl  # pylint: disable=g-import-not-at-top

  def run(workdir, pipelined, steps_now):
    config = quickstart.get_config("smoke")
    with config.unlocked():
      config.pipeline = pipelined
      config.log_every = 1
      config.num_train_steps = steps_now
      config.model.num_unique = 64  # dedup on every table
    return train_lib.train_and_evaluate(config, str(workdir))

  run(tmp_path / "in_line", False, 6)
  run(tmp_path / "pipelined", True, 3)
  run(tmp_path / "pipelined", True, 6)  # resumes from the checkpoint at step 3
  for name in ("train.jsonl", "eval.jsonl"):
    want = [{k: v for k, v in r.items() if k != "examples_per_sec"}
            for r in read_jsonl(tmp_path / "in_line" / name)]
    got = [{k: v for k, v in r.items() if k != "examples_per_sec"}
           for r in read_jsonl(tmp_path / "pipelined" / name)]
    assert got == want, name
