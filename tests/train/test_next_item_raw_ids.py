"""Raw MovieLens ids into SASRec's and HSTU's tied dynamic item table (``config.data.raw_ids``).

The file's ids are large and sparse (``test_movielens_raw_ids``'s fixture):
the model must look inputs and targets up as one step of the table's
policy, score the table's resident rows only, and its eval must rank a
held-out movie among them by its raw id.
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from embedlib import DynamicEmbed, dynamic, optim, serving
from embedlib.data import movielens as ml
from embedlib.data import next_item as ni
from embedlib.dynamic import mapping
from embedlib.training import export_lib, setup, tasks, train_lib
from embedlib.training.writers import read_jsonl
from tests.train.test_movielens_raw_ids import _check_table, _config, data  # noqa: F401

MISS = np.iinfo(np.int32).max
K = 5


def _seen(config):
  """The raw movie ids of the run's training batches (inputs and targets), as a set."""
  made = tasks.make_task(config)
  train, _ = made.sources(made.data_spec(), batch_size=config.batch_size, seed=config.seed,
                          eval_batches=config.eval_batches)
  out = set()
  for _ in range(config.num_train_steps):
    batch = next(train)
    for k in ("items", "targets"):
      out |= {int(v) for v in np.asarray(batch[k]).ravel() if v >= 0}
  return out


def test_the_source_yields_the_files_movie_ids_padded_with_minus_one(data):  # noqa: F811
  split = ml.leave_one_out(ml.load(data))
  for kind in ni.KINDS:
    kw = dict(max_len=8, batch_size=16, kind=kind, exclude_seen=kind != ni.TRAIN)
    dense, raw = (ni.NextItemSource(split, raw_ids=r, **kw).batch(1) for r in (False, True))
    for key in ("items", "targets", "target", "exclude"):
      if key in dense:
        want = np.where(dense[key] > 0, split.raw_item_ids[dense[key]], -1)
        np.testing.assert_array_equal(raw[key], want)
        assert raw[key].dtype == np.int32 and (raw[key] > 1_000_000).any()
    np.testing.assert_array_equal(raw["times"], dense["times"])


@pytest.fixture(scope="module")
def sasrec(data, tmp_path_factory):  # noqa: F811
  """The smoke SASRec run on raw ids: ``(config, workdir, model)``, the model restored."""
  config = _config("sasrec", data)
  workdir = tmp_path_factory.mktemp("sasrec")
  train_lib.train_and_evaluate(config, str(workdir))
  model, _ = setup.restore_model(config, str(workdir))
  return config, workdir, model


def test_sasrec_trains_on_raw_ids_and_ranks_the_resident_movies(sasrec):
  config, workdir, model = sasrec
  items = model.items
  assert isinstance(items, DynamicEmbed)
  _check_table(items, _seen(config))
  # One step of its policy per training step (inputs and targets together); evals admit none.
  assert int(items.clock[...]) == config.num_train_steps
  last = read_jsonl(workdir / "train.jsonl")[-1]
  assert last["dynamic/embed/items/evicted"] == 0

  # The test metrics, ranked here in numpy over the resident movies by their raw ids.
  made = tasks.make_task(config)
  _, valid = made.sources(made.data_spec(), batch_size=config.batch_size, seed=config.seed,
                          eval_batches=config.eval_batches)
  resident = items.resident()
  keys = np.array(sorted(resident), np.int64)
  rows = np.array([resident[k] for k in keys])
  table = np.asarray(items.rows.embedding[...])[rows]        # [R, width], by raw id
  bias = model.embed.repeat_logit
  with dynamic.frozen_maps(model):
    ranks = []
    for batch in valid.test_source:
      batch = made.featurize(batch)
      index = np.vectorize(lambda v: resident.get(int(v), -1) + 1)(batch["items"])
      hidden = np.asarray(model(dict(batch, items=jnp.asarray(index, jnp.int32)))[:, -1])
      scores = hidden @ table.T
      for r, target in enumerate(batch["target"]):
        if not batch["weight"][r]:
          continue
        s = scores[r] + bias * np.isin(keys, batch["items"][r])
        at = np.flatnonzero(keys == target)
        ranks.append(int((s > s[at[0]]).sum()) if len(at) else MISS)
  ranks = np.array(ranks)
  test = read_jsonl(workdir / "eval.jsonl")[-1]
  assert len(ranks) == 40 and 0 < (ranks < MISS).mean() < 1   # some test movies unseen
  for k in (10, 20):
    assert test[f"test_hr@{k}"] == pytest.approx((ranks < k).mean())
    assert test[f"test_ndcg@{k}"] == pytest.approx(
        np.mean(np.where(ranks < k, 1 / np.log2(np.minimum(ranks, k) + 2.0), 0)))


def test_rows_without_an_id_are_masked_out_of_the_logits(sasrec):
  config, _, model = sasrec
  known = sorted(model.items.resident())[:2]
  batch = {"items": jnp.array([[-1] * 5 + known + [7]], jnp.int32)}   # 7: never seen
  with dynamic.frozen_maps(model):
    batch = model.to_rows(batch)
    logits = np.asarray(model.logits(model(batch)[:, -1], batch["items"]))
  assert np.asarray(batch["items"][0]).tolist() == (
      [0] * 5 + [model.items.resident()[k] + 1 for k in known] + [0])
  assert logits.shape == (1, config.model.dynamic.item.capacity)
  finite = np.flatnonzero(logits[0] > np.finfo(np.float32).min)
  assert set(finite) == set(model.items.resident().values())
  assert int(model.items.clock[...]) == config.num_train_steps   # looked up, not admitted


def test_the_artifact_returns_the_resident_movies_raw_ids(sasrec, tmp_path):
  import io  # pylint: disable=import-outside-toplevel

  from train import predict as predict_lib  # pylint: disable=import-outside-toplevel

  config, workdir, _ = sasrec
  _, model, mesh = export_lib.restore(str(workdir), 1)   # train.export's: onto one device
  export_lib.export(config, model, mesh, str(tmp_path / "art"), batch_size=8, top_k=K,
                    exclude_input=True)
  served = serving.load(tmp_path / "art")
  (spec,) = served.manifest["inputs"]
  assert spec["kind"] == "raw_ids" and spec["table"] == model.items.name
  assert served.manifest["dynamic_tables"][model.items.name]["features"] == ["items"]
  assert "raw_item_ids" not in served.manifest["data"]   # the outputs are the file's ids
  resident = model.items.resident()
  movie_of = {row: movie for movie, row in resident.items()}
  made = tasks.make_task(config)
  _, valid = made.sources(made.data_spec(), batch_size=config.batch_size, seed=config.seed,
                          eval_batches=config.eval_batches)
  history = made.featurize(next(valid.test_source))["items"]
  history[0, -1] = 7                                      # a movie never seen reads as padding
  got = served({"items": history.astype(np.int64)})
  with dynamic.frozen_maps(model):
    batch = model.to_rows({"items": jnp.asarray(history)})
    scores = np.array(model.logits(model(batch)[:, -1], batch["items"]))
  rows = np.arange(scores.shape[1])
  scores[:, ~np.isin(rows, list(movie_of))] = -np.inf
  for r, index in enumerate(np.asarray(batch["items"])):
    scores[r, index[index > 0] - 1] = -np.inf            # the history's own movies
  best = np.argsort(-scores, axis=1, kind="stable")[:, :K]
  np.testing.assert_array_equal(got["items"], np.vectorize(movie_of.get)(best))
  np.testing.assert_allclose(got["scores"], np.take_along_axis(scores, best, 1), rtol=1e-5)
  assert not any(set(top) & set(h) for top, h in zip(got["items"], history))

  # Quantized (int8 rows, the tied attend from the codes): the in-process quantized program's.
  export_lib.export(config, model, mesh, str(tmp_path / "int8"), batch_size=8, top_k=K,
                    exclude_input=True, bits=8)
  quantized = serving.load(tmp_path / "int8")
  got = quantized({"items": history})
  score = export_lib.scoring(config, model, mesh, top_k=K, exclude_input=True)
  jitted, _, weights, _ = export_lib.serving_function(model, mesh, score, 8)
  columns, _ = quantized._columns({"items": history[:8]})  # pylint: disable=protected-access
  items, values = jitted(*weights, *columns)
  np.testing.assert_array_equal(got["items"][:8], items)
  np.testing.assert_array_equal(got["scores"][:8], values)
  assert set(got["items"].ravel()) <= set(resident)

  # train.predict: each user's top K from the file's own ids, movies of the table only.
  out = io.StringIO()
  assert predict_lib.predict_next_items(served, config.data.path, out, batch_size=16) == 40
  lines = out.getvalue().splitlines()
  data = ml.load(config.data.path)
  assert [int(line.split("\t")[0]) for line in lines] == data.raw_user_ids.tolist()
  for line in lines:
    top = [int(x) for x in line.split("\t")[1].split()]
    assert len(top) == K and set(top) <= set(resident)


def test_a_densely_trained_table_gets_gradients_and_fresh_adam_moments_for_placed_rows():
  class Model(nnx.Module):
    def __init__(self):
      self.items = DynamicEmbed(128, 2, bucket_size=64, rngs=nnx.Rngs(0))

  model = Model()
  opt = optim.SparseAwareOptimizer(model, optax.adam(0.1), None)   # the table trains densely
  state = opt.dense.opt_state[0]
  for moment in (state.mu, state.nu):
    moment["items"]["rows"]["embedding"][...] = jnp.full((128, 2), 3.0)

  def loss(m):
    return (m.items(np.array([5, 6, -1])) * jnp.array([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]])).sum()

  grads = nnx.grad(loss)(model)
  rows = np.array(sorted(model.items.resident().values()))
  got = np.asarray(grads["items"]["rows"]["embedding"][...])
  placed = {model.items.resident()[i]: w for i, w in ((5, [1, 2]), (6, [3, 4]))}
  want = np.zeros((128, 2))
  for r, w in placed.items():
    want[r] = w
  np.testing.assert_array_equal(got, want)   # the placement passes the gradient through
  dynamic.reset_slots(opt, model)
  for moment in (state.mu, state.nu):
    value = np.asarray(moment["items"]["rows"]["embedding"][...])
    assert (value[rows] == 0).all() and (np.delete(value, rows, axis=0) == 3).all()
  assert int(model.items.slots_clock[...]) == 1
  # The dense update moves the rows no id holds yet: their first placement is drawn afresh.
  assert (np.delete(np.asarray(model.items.placed_at[...]), rows) == 0).all()
  model.items.rows.embedding[...] += 1.0
  model.items(np.array([7]))
  row = model.items.resident()[7]
  want = mapping.init_rows(model.items.embedding_init, model.items.init_key[...],
                           jnp.array([row]), 2, jnp.float32)
  # Its initial value, not the moved one.
  np.testing.assert_array_equal(model.items.rows.embedding[...][row], want[0])


@pytest.mark.slow
def test_hstu_trains_on_raw_ids(data, tmp_path):  # noqa: F811
  config = _config("hstu", data)
  train_lib.train_and_evaluate(config, str(tmp_path))
  model, _ = setup.restore_model(config, str(tmp_path))
  _check_table(model.items, _seen(config))
  assert int(model.items.clock[...]) == config.num_train_steps
  assert 0 < read_jsonl(tmp_path / "eval.jsonl")[-1]["test_hr@20"] <= 1


@pytest.mark.parametrize("change, match", [
    (lambda c: c.model.dynamic.update(user=c.model.dynamic.item),
     r"config.model.dynamic.user: config.model.name='sasrec' has no dynamic table 'user'"),
    (lambda c: c.model.dynamic.__delattr__("item"),
     r"config.model.dynamic.item: config.model.name='sasrec' reads raw item ids"),
    (lambda c: c.model.dynamic.item.update(default="learned"),
     r"config.model.dynamic.item.default: .*use default='zero'"),
    (lambda c: c.model.dynamic.item.update(eviction="fifo"),
     r"config.model.dynamic.item.eviction: .*'none'"),
])
def test_bad_next_item_dynamic_key_names_it(data, change, match):  # noqa: F811
  config = _config("sasrec", data)
  with config.unlocked():
    change(config)
  with pytest.raises(tasks.ConfigError, match=match):
    tasks.make_task(config)


@pytest.mark.slow
def test_pipelined_sasrec_on_raw_ids_equals_the_in_line_run(data, tmp_path):  # noqa: F811
  runs = []
  for pipeline in (False, True):
    config = _config("sasrec", data)
    config.pipeline = pipeline
    train_lib.train_and_evaluate(config, str(tmp_path / str(pipeline)))
    runs.append([{k: v for k, v in r.items() if k != "examples_per_sec"}
                 for r in read_jsonl(tmp_path / str(pipeline) / "train.jsonl")]
                + read_jsonl(tmp_path / str(pipeline) / "eval.jsonl"))
  assert runs[0] == runs[1] and "dynamic/embed/items/occupancy" in runs[0][-3]


@pytest.mark.slow
def test_a_full_tied_table_evicts_and_keeps_distinct_rows(data, tmp_path):  # noqa: F811
  config = _config("sasrec", data)
  config.model.dynamic.item.update(capacity=128, bucket_size=16)   # 1 bucket per device
  train_lib.train_and_evaluate(config, str(tmp_path))
  model, _ = setup.restore_model(config, str(tmp_path))
  resident, seen = model.items.resident(), _seen(config)
  # Far more movies than rows: the buckets filled and evicted (LRU).
  assert set(resident) < seen and len(resident) == 128 < len(seen)
  assert len(set(resident.values())) == len(resident)
  logs = read_jsonl(tmp_path / "train.jsonl")
  assert all(np.isfinite(r["loss"]) for r in logs)
  assert 0 <= read_jsonl(tmp_path / "eval.jsonl")[-1]["test_hr@20"] <= 1


@pytest.mark.slow
def test_a_resumed_run_on_a_full_tied_table_equals_an_uninterrupted_one(data, tmp_path):  # noqa: F811
  def config_of(steps):
    config = _config("sasrec", data)
    config.model.dynamic.item.update(capacity=128, bucket_size=16)   # it evicts (above)
    config.num_train_steps = steps
    return config

  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  train_lib.train_and_evaluate(config_of(6), str(straight))
  train_lib.train_and_evaluate(config_of(4), str(resumed))   # the logged losses: 2 steps each
  train_lib.train_and_evaluate(config_of(6), str(resumed))
  # The map, its clocks and the dense slots of the rows placed after step 4 come back exactly.
  loss = lambda d: [r["loss"] for r in read_jsonl(d / "train.jsonl") if r["step"] > 4]
  assert loss(resumed) == loss(straight)
  last = lambda d: read_jsonl(d / "eval.jsonl")[-1]
  assert last(resumed) == last(straight)
  models = [setup.restore_model(config_of(6), str(d))[0] for d in (straight, resumed)]
  assert models[0].items.resident() == models[1].items.resident()
