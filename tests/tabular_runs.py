"""Small logs of a team's own (Parquet, CSV, RecBole) and the tabular smoke runs on them.

Shared by ``tests/train/test_tabular.py`` and ``tests/serving/test_tabular.py``:
the same config on the same rows compiles the same steps, so a process
running both compiles them once.

The Parquet and CSV logs are ``embedlib.tabular.synth``'s click log (string
user ids, an int item id, a list column, dense columns with nulls); the
RecBole dataset is written here, with ``.user`` and ``.item`` side files
as ML-100K's (age, gender, occupation; title and genres as token lists).
"""

import logging
import os
import sys

import numpy as np
import pyarrow.parquet as pq

from configs import tabular as tabular_config
from embedlib.tabular import synth

#: Rows of the Parquet and CSV logs: about 480 train, 60 eval and 60 test rows.
ROWS = 600
USERS, ITEMS = 50, 40


def parquet_log(directory) -> str:
  """The click log as two Parquet files of 128-row groups (5 chunks, 300 rows a file)."""
  synth.write(str(directory), rows_total=ROWS, files=2, row_group=128, users=USERS,
              items=ITEMS)
  return str(directory)


def csv_log(directory, *, second_label: bool = False) -> str:
  """The same rows as one CSV file (lists joined by '|', nulls empty); its path.

  With ``second_label`` a column ``bought`` follows ``clicked``: a third of
  the clicks (by row number) are purchases.
  """
  (path,) = synth.write(str(directory), rows_total=ROWS, files=1, fmt="csv", users=USERS,
                        items=ITEMS)
  if second_label:
    lines = open(path, encoding="utf-8").read().splitlines()
    out = [lines[0] + ",bought"]
    for i, line in enumerate(lines[1:]):
      out.append(f"{line},{int(line.endswith(',1') and i % 3 == 0)}")
    with open(path, "w", encoding="utf-8") as f:
      f.write("\n".join(out) + "\n")
  return path


def rewrite_parquet(source: str, target: str, change) -> str:
  """Each Parquet file of ``source`` written to ``target`` as ``change(table)``; ``target``."""
  os.makedirs(target, exist_ok=True)
  for name in sorted(os.listdir(source)):
    table = change(pq.read_table(os.path.join(source, name)))
    pq.write_table(table, os.path.join(target, name), row_group_size=128)
  return str(target)


GENRES = ("Action", "Comedy", "Drama", "Horror", "Romance")


def recbole_dataset(directory, *, users: int = 30, items: int = 40, rows: int = 400) -> str:
  """A RecBole atomic dataset ``tiny`` (``.inter``, ``.user``, ``.item``); the ``.inter`` path.

  A rating is a function of the user and the item plus a coin, so the
  ratings of 4 and 5 (the clicks) can be learnt from the ids and side
  columns alike.
  """
  os.makedirs(directory, exist_ok=True)
  stem = os.path.join(str(directory), "tiny")
  rng = np.random.default_rng(0)
  with open(stem + ".user", "w", encoding="utf-8") as f:
    f.write("user_id:token\tage:token\tgender:token\toccupation:token\n")
    for u in range(1, users + 1):
      job = ("student", "writer", "other")[u % 3]
      f.write(f"{u}\t{20 + u % 5 * 10}\t{'MF'[u % 2]}\t{job}\n")
  with open(stem + ".item", "w", encoding="utf-8") as f:
    f.write("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n")
    for i in range(1, items + 1):
      genres = " ".join(GENRES[(i + k) % len(GENRES)] for k in range(1 + i % 3))
      f.write(f"{i}\tMovie {i}\t{1990 + i % 7}\t{genres}\n")
  with open(stem + ".inter", "w", encoding="utf-8") as f:
    f.write("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
    for r in range(rows):
      u, i = 1 + int(rng.integers(users)), 1 + int(rng.integers(items))
      rating = 1 + (3 * u + 5 * i + int(rng.integers(2))) % 5
      f.write(f"{u}\t{i}\t{rating}\t{880000000 + 60 * r}\n")
  return stem + ".inter"


def config(path, *, label: str = "clicked", **overrides):
  """``configs/tabular.py:smoke,PATH`` with ``--config.data.label=LABEL`` and dotted overrides.

  >>> config("logs/", num_train_steps=3, **{"model.name": "dcn_v2"}).model.name
  'dcn_v2'
  """
  made = tabular_config.get_config(f"smoke,{path}")
  made.data.label = label
  for key, value in overrides.items():
    *parents, last = key.split(".")
    node = made
    for part in parents:
      node = node[part]
    node[last] = value
  return made


def parsed_config(argv, monkeypatch):
  """The config ``python -m train`` parses from ``argv`` (its ``--config`` flag, as train/ has it)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True)
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads the overrides from sys.argv
  values(argv)
  return values.config


class Messages(logging.Handler):
  """The ``embedlib`` loggers' messages while open (a module fixture has no ``caplog``)."""

  def __init__(self):
    super().__init__(logging.INFO)
    self.lines = []
    self._logger = logging.getLogger("embedlib")
    self._level = self._logger.level

  def emit(self, record):
    self.lines.append(record.getMessage())

  def __enter__(self):
    self._logger.addHandler(self)
    self._logger.setLevel(logging.INFO)
    return self

  def __exit__(self, *exc):
    self._logger.removeHandler(self)
    self._logger.setLevel(self._level)
    return False
