"""Raw MovieLens ids into dynamic tables (``config.data.raw_ids``): the ranker and the two towers.

The file's ids are large and sparse (movie ``i`` is ``1000003 + 7919 i``),
so a reader that numbered them densely, or a table that wrapped them,
would leave other ids resident than the ones the training batches held.
"""

import numpy as np
import pytest
from flax import nnx

from configs import movielens
from embedlib import DynamicEmbed, serving
from embedlib.data import movielens as ml
from embedlib.data import movielens_requests as mr
from embedlib.training import events, export_lib, setup, tasks, train_lib
from embedlib.training.writers import read_jsonl
from tests.train.test_sequential import write_ml100k

PAD = 2**64 - 1
K = 5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  # 300 movies among 40 users: many a held-out movie is never in a training batch.
  folder = write_ml100k(tmp_path_factory.mktemp("data") / "ml-100k", num_items=300)
  lines = []
  for line in (folder / "u.data").read_text().splitlines():
    user, item, rating, time = line.split("\t")
    lines.append(f"{50000 + 31 * int(user)}\t{1000003 + 7919 * int(item)}\t{rating}\t{time}\n")
  (folder / "u.data").write_text("".join(lines))
  return folder


def _config(model, path):
  config = movielens.get_config(f"smoke,{model}")
  config.data.path, config.data.raw_ids = str(path), True
  return config


def _seen(config, keys):
  """The raw ids of ``keys`` (users: ``user``) in the run's training batches, as a set."""
  made = tasks.make_task(config)
  train, _ = made.sources(made.data_spec(), batch_size=config.batch_size, seed=config.seed,
                          eval_batches=config.eval_batches)
  out = set()
  for _ in range(config.num_train_steps):
    batch = next(train)
    for k in keys:
      out |= {int(v) for v in np.asarray(batch[k]).ravel() if v >= 0}
  return out


def _check_table(table: DynamicEmbed, expected: set):
  resident = table.resident()
  assert set(resident) == expected and PAD not in resident
  assert len(set(resident.values())) == len(resident)  # distinct ids, distinct rows


def test_requests_carry_the_files_ids_exactly(data):
  split = ml.leave_one_out(ml.load(data))
  for cls, extra in ((mr.RetrievalRequests, dict(exclude_seen=True)),
                     (mr.RankingRequests, dict(num_candidates=3))):
    for kind in mr.KINDS:
      kw = dict(history_len=8, batch_size=16, kind=kind, **extra)
      dense, raw = (cls(split, raw_ids=r, **kw).batch(1) for r in (False, True))
      assert (raw["user"] == split.raw_user_ids[dense["user"]]).all()
      for key in ("history_item", "item", "candidate_item"):
        if key in dense:
          want = np.where(dense[key] >= 0, split.raw_item_ids[dense[key] + 1], -1)
          np.testing.assert_array_equal(raw[key], want)
          assert raw[key].dtype == np.int32 and (raw[key] >= 0).any()
      if "exclude" in dense:
        np.testing.assert_array_equal(
            raw["exclude"], np.where(dense["exclude"] > 0, split.raw_item_ids[dense["exclude"]],
                                     -1))
  big = split.__class__(**{**split.__dict__, "raw_item_ids": split.raw_item_ids + 2**31})
  with pytest.raises(ValueError, match=r"raw movie id 2\d+ lies outside \[0, 2\*\*31"):
    mr.RetrievalRequests(big, history_len=8, batch_size=16, raw_ids=True)


def test_two_towers_train_on_raw_ids_and_rank_the_resident_movies(data, tmp_path):
  config = _config("two_tower", data)
  train_lib.train_and_evaluate(config, str(tmp_path))
  model, mesh = setup.restore_model(config, str(tmp_path))
  items, user = model.items, model.user_tower.user
  _check_table(items, _seen(config, ("history_item", "item")))
  _check_table(user, _seen(config, ("user",)))
  # One step of its policy per training step (history and items together); evals admit none.
  assert int(items.clock[...]) == config.num_train_steps
  last = read_jsonl(tmp_path / "train.jsonl")[-1]
  assert last["dynamic/items/evicted"] == 0 and last["dynamic/items/default_share"] == 0
  # Each table's stats go to TensorBoard beside the loss, as in the jsonl record.
  tb = events.read_scalars(str(tmp_path / "tensorboard" / "train"))
  stats = {k: v for k, v in last.items() if k.startswith("dynamic/")}
  assert {f"dynamic/items/{s}" for s in ("occupancy", "admitted", "evicted",
                                         "default_share")} <= stats.keys()
  assert len(stats) == 8 and "loss" in tb, sorted(stats)  # the user table's four too
  for key, value in stats.items():
    assert tb[key][-1] == (last["step"], pytest.approx(value)), key

  # The test metrics, ranked here over the resident movies by their raw ids.
  made = tasks.make_task(config)
  _, valid = made.sources(made.data_spec(), batch_size=config.batch_size, seed=config.seed,
                          eval_batches=config.eval_batches)
  keys = np.array(sorted(items.resident()), np.int32)
  items.deterministic = user.deterministic = True
  corpus = np.asarray(model.candidates(keys, np.zeros(len(keys), np.int32)))
  ranks = []
  for batch in valid.test_source:
    users = np.asarray(model.users(made.featurize(batch)))
    scores = users @ corpus.T
    for row, target in enumerate(batch["item"]):
      if batch["weight"][row]:
        at = np.flatnonzero(keys == target)
        ranks.append(int((scores[row] > scores[row, at[0]]).sum()) if len(at) else 1 << 30)
  ranks = np.array(ranks)
  test = read_jsonl(tmp_path / "eval.jsonl")[-1]
  assert len(ranks) == 40 and (ranks < (1 << 30)).mean() < 1   # some test movies unseen
  assert test["test_hr@20"] == pytest.approx((ranks < 20).mean())
  assert test["test_ndcg@10"] == pytest.approx(np.mean((ranks < 10) / np.log2(ranks + 2.0)))

  # The artifact: raw ids in, the top K resident movies' raw ids out, as ranked here.
  export_lib.export(config, model, mesh, str(tmp_path / "art"), batch_size=8, top_k=K)
  served = serving.load(tmp_path / "art")
  assert {s["name"]: s["kind"] for s in served.manifest["inputs"]} == {
      "user": "raw_ids", "history_item": "raw_ids", "history_author": "ids",
      "history_actions": "dense"}
  tables = served.manifest["dynamic_tables"]
  assert sorted(tables) == sorted([items.name, user.name])
  assert tables[items.name]["features"] == ["history_item"]
  assert tables[user.name]["features"] == ["user"]
  assert served.resident(items.name) == items.resident()
  assert served.resident(user.name) == user.resident()
  valid.test_source.set_state({"position": 0})
  batch = made.featurize(next(valid.test_source))
  inputs = {n: batch[n] for n in served.input_names}
  got = served(inputs)
  scores = np.asarray(model.users(batch)) @ corpus.T
  best = np.argsort(-scores, axis=1, kind="stable")[:, :K]
  np.testing.assert_array_equal(got["items"], keys[best])
  np.testing.assert_allclose(got["scores"], np.take_along_axis(scores, best, 1), rtol=1e-5)
  # A user id past 2**32, or one never seen, reads the user table's default alike.
  unseen = [dict(inputs, user=np.full(len(batch["user"]), v, dtype)) for v, dtype in
            ((2**40 + 5, np.uint64), (3, np.int64))]
  far, small = (served(x) for x in unseen)
  np.testing.assert_array_equal(far["items"], small["items"])


@pytest.mark.slow
def test_ranker_reads_history_and_candidates_through_one_raw_item_table(data, tmp_path):
  config = _config("ranker", data)
  train_lib.train_and_evaluate(config, str(tmp_path))
  model, _ = setup.restore_model(config, str(tmp_path))
  trunk = model.trunk
  _check_table(trunk.items, _seen(config, ("history_item", "candidate_item")))
  _check_table(trunk.user, _seen(config, ("user",)))
  # One step of the item table's policy per training step: history and candidates together.
  assert int(trunk.items.clock[...]) == config.num_train_steps
  assert 0 < read_jsonl(tmp_path / "eval.jsonl")[-1]["test_ndcg@10"] <= 1


@pytest.mark.slow
def test_pipelined_ranker_on_raw_ids_equals_the_in_line_run(data, tmp_path):
  runs = []
  for pipeline in (False, True):
    config = _config("ranker", data)
    config.pipeline = pipeline
    train_lib.train_and_evaluate(config, str(tmp_path / str(pipeline)))
    runs.append([{k: v for k, v in r.items() if k != "examples_per_sec"}
                 for r in read_jsonl(tmp_path / str(pipeline) / "train.jsonl")]
                + read_jsonl(tmp_path / str(pipeline) / "eval.jsonl"))
  assert runs[0] == runs[1] and "dynamic/trunk/items/occupancy" in runs[0][-3]


@pytest.mark.parametrize("model, change, match", [
    ("ranker", lambda c: c.model.dynamic.update(author=c.model.dynamic.item),
     r"config.model.dynamic.author: config.model.name='ranker' has no dynamic table 'author'"),
    ("two_tower", lambda c: c.model.dynamic.__delattr__("item"),
     r"config.model.dynamic.item: config.model.name='two_tower' reads raw item ids"),
    ("two_tower", lambda c: c.model.dynamic.user.update(eviction="fifo"),
     r"config.model.dynamic.user.eviction: .*'none'"),
    ("ranker", lambda c: c.model.dynamic.item.update(capacity=0),
     r"config.model.dynamic.item.capacity: give the table's rows"),
])
def test_bad_dynamic_key_names_it(data, model, change, match):
  config = _config(model, data)
  with config.unlocked():
    change(config)
  with pytest.raises(tasks.ConfigError, match=match):
    tasks.make_task(config)


def test_capacity_the_mesh_cant_split_and_planted_raw_ids_name_their_key(data):
  config = _config("ranker", data)
  config.model.dynamic.item.capacity = 128       # 4 buckets of 32 for 8 devices
  made = tasks.make_task(config)
  with pytest.raises(ValueError, match=r"config.model.dynamic.item.capacity: .*whole buckets"):
    setup.model_and_optimizer(config, made, made.data_spec(), setup.make_mesh(config))
  from configs import ranker  # pylint: disable=g-import-not-at-top
  planted = ranker.get_config("smoke")
  planted.data.raw_ids = True
  with pytest.raises(tasks.ConfigError, match=r"config.data.raw_ids: the planted_ranking"):
    tasks.make_task(planted)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["two_tower", "ranker", "sasrec"])
def test_raw_ids_in_two_processes_match_one(data, model, tmp_path):
  """2 processes x 4 devices admit the same movies and users as 1 x 8, and train alike.

  Each process reads its slice of every batch and routes its raw ids to the
  maps' owners; the per-table statistics (occupancy, admitted, evicted,
  default share) are equal exactly, the losses and metrics to 1e-4.
  """
  from tests.train import test_multihost as multihost  # pylint: disable=import-outside-toplevel

  config = _config(model, data)
  evals = {"two_tower": ["ndcg@10", "hr@20"], "sasrec": ["ndcg@20", "hr@20"],
           "ranker": ["auc_mean", "ndcg@10"]}[model]
  single, multi = multihost._one_and_two_processes(  # pylint: disable=protected-access
      tmp_path, f"--config.data.path={data}", "--config.data.raw_ids=True",
      config=f"configs/movielens.py:smoke,{model}",
      keys=(("train.jsonl", ["loss"]), ("eval.jsonl", evals)))
  one, two = read_jsonl(single / "train.jsonl"), read_jsonl(multi / "train.jsonl")
  keys = sorted(k for k in one[0] if k.startswith("dynamic/"))
  assert keys and keys == sorted(k for k in two[0] if k.startswith("dynamic/"))
  assert [[r[k] for k in keys] for r in two] == [[r[k] for k in keys] for r in one]
  a, _ = setup.restore_model(config, str(single))
  b, _ = setup.restore_model(config, str(multi))
  tables = lambda m: {path: t for path, t in nnx.iter_graph(m) if isinstance(t, DynamicEmbed)}
  ones, twos = tables(a), tables(b)
  assert ones and ones.keys() == twos.keys()
  for path, table in ones.items():
    assert table.resident() == twos[path].resident() and table.resident(), path
