"""SASRec with the items' side columns (``config.data.item_columns``) of RecBole's ``.item`` file.

A tiny RecBole dataset (``.inter`` and ``.item``): the model reads each
movie's genres and year beside its id, and those columns change what it
computes; the task refuses columns the file lacks, float columns, files
without an ``.item`` and raw ids, naming the key.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import movielens
from embedlib import ShardedEmbed
from embedlib.tabular import item_side
from embedlib.models.next_item import ItemColumns
from embedlib.models.sasrec import SASRec
from embedlib.training import setup, train_lib
from embedlib.training.tasks import ConfigError
from embedlib.training.writers import read_jsonl

GENRES = ("Action", "Comedy", "Drama", "Horror")


def write_recbole(folder, num_users=30, num_items=40, seed=0):
  rng = np.random.default_rng(seed)
  folder.mkdir()
  lines = ["user_id:token\titem_id:token\trating:float\ttimestamp:float\n"]
  for user in range(1, num_users + 1):
    for t, item in enumerate(rng.choice(num_items, rng.integers(5, 12), replace=False) + 1):
      lines.append(f"{user}\t{item}\t{rng.integers(1, 6)}\t{880000000 + 3600 * t + user}\n")
  (folder / "tiny.inter").write_text("".join(lines))
  items = ["item_id:token\trelease_year:token\tclass:token_seq\tscore:float\n"]
  for item in range(1, num_items + 1):
    genres = " ".join(rng.choice(GENRES, rng.integers(1, 3), replace=False))
    items.append(f"{item}\t{1990 + item % 7}\t{genres}\t{rng.random():.3f}\n")
  (folder / "tiny.item").write_text("".join(items))
  return folder / "tiny.inter"


@pytest.fixture(scope="module")
def inter(tmp_path_factory):
  return write_recbole(tmp_path_factory.mktemp("data") / "tiny")


def _config(path, **data):
  config = movielens.get_config("smoke")
  config.data.path = str(path)
  config.data.update(data)
  return config


def test_side_columns_follow_the_items_of_the_split(inter):
  split = setup.task(_config(inter)).split
  side = item_side.read(str(inter).replace(".inter", ".item"), ("class", "release_year"),
                        split.raw_item_ids)
  rows = {}
  for line in (inter.parent / "tiny.item").read_text().splitlines()[1:]:
    item, year, genres, _ = line.split("\t")
    rows[item] = (year, genres.split())
  years = side["release_year"]
  assert years.shape == (split.num_items + 1, 1) and (years[0] == -1).all()
  # Same year, same id; different years, different ids.
  by_year = {}
  for dense, raw in enumerate(split.raw_item_ids[1:], start=1):
    by_year.setdefault(rows[str(raw)][0], set()).add(int(years[dense, 0]))
  assert all(len(ids) == 1 for ids in by_year.values())
  assert len({next(iter(v)) for v in by_year.values()}) == len(by_year)
  genres = side["class"]
  for dense, raw in enumerate(split.raw_item_ids[1:], start=1):
    assert (genres[dense] >= 1).sum() == len(rows[str(raw)][1])


def test_sasrec_reads_the_side_columns():
  columns = {"genre": np.array([[-1, -1], [1, 2], [2, -1], [1, -1]], np.int32)}
  items = ShardedEmbed(4, 8, rngs=nnx.Rngs(0))
  side = ItemColumns(columns, 8, rngs=nnx.Rngs(1))
  pooled = side(jnp.array([[0, 1, 2]]))
  table = side.embeddings.tables["genre"].embedding[...]
  np.testing.assert_allclose(pooled[0, 0], 0.0)
  np.testing.assert_allclose(pooled[0, 1], (table[1] + table[2]) / 2, rtol=1e-6)
  np.testing.assert_allclose(pooled[0, 2], table[2], rtol=1e-6)
  batch = {"items": jnp.array([[0, 3, 1, 2]])}
  with_side = SASRec(items, max_len=4, num_layers=1, num_heads=2, side=side, rngs=nnx.Rngs(2))
  plain = SASRec(items, max_len=4, num_layers=1, num_heads=2, rngs=nnx.Rngs(2))
  assert not np.allclose(with_side(batch), plain(batch))


def test_a_run_with_item_columns_trains_and_tests(inter, tmp_path):
  config = _config(inter, item_columns="class,release_year")
  result = train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert "test_ndcg@10" in result
  evals = read_jsonl(tmp_path / "run" / "eval.jsonl")
  assert [e["step"] for e in evals] == [3, 6]


@pytest.mark.parametrize("data, match", [
    (dict(item_columns="class,nope"), r"config.data.item_columns: .* has no item column 'nope'"),
    (dict(item_columns="score"), r"config.data.item_columns: 'score' is float"),
    (dict(item_columns="class", raw_ids=True), r"config.data.item_columns: .*raw_ids off"),
])
def test_bad_item_columns_name_the_key(inter, tmp_path, data, match):
  with pytest.raises(ConfigError, match=match):
    train_lib.train_and_evaluate(_config(inter, **data), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
